"""The report as one self-contained HTML page: styles and figures inline, nothing fetched from a network."""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable

from lightning_vram.records import CATEGORIES, Advice, NotAdvised, Report, in_phase_order
from lightning_vram.render.figure_set import (
    BREAKDOWN_TAG,
    MEMORY_OVER_STEPS_TAG,
    STEP_MEMORY_TAG,
    TOP_MODULES_TAG,
    FigurePngs,
    report_pngs,
)
from lightning_vram.render.markup import Token, advice_tokens
from lightning_vram.render.shapes import lengths_table, shapes_sentence, shows_lengths
from lightning_vram.render.simulation import Table, simulation_view
from lightning_vram.render.text import (
    breakdown_instant_note,
    capacity_text,
    evaluation_text,
    fit_assumption,
    has_step_time,
    headline,
    peak_label,
    predicted_step_text,
    ranks_line,
    report_steps_text,
    saving_text,
    several_updates_note,
    spread_note,
    timing_line,
)
from lightning_vram.units import format_bytes

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
h1, h2, h3, p, li { overflow-wrap: anywhere; }
.headline { font-size: 1.2rem; font-weight: 600; background: #f3f6fb; padding: .8rem 1rem; border-radius: 6px; }
.scroll { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; margin: .5rem 0; }
td, th { padding: .25rem .6rem; border-bottom: 1px solid #eee; overflow-wrap: break-word; vertical-align: top; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; } td.n { white-space: nowrap; }
.advice { border-left: 4px solid #4C72B0; padding: .2rem 1rem; margin: 1rem 0; background: #fafafa; }
.advice.critical { border-color: #C44E52; } .advice.warning { border-color: #DD8452; }
.meta { color: #555; } pre { background: #f0f0f0; padding: .6rem; white-space: pre-wrap; overflow-wrap: anywhere; }
code { overflow-wrap: anywhere; } img { max-width: 100%; height: auto; }
@media (max-width: 40rem) { body { margin: 1rem auto; padding: 0 .5rem; } td, th { padding: .2rem .3rem; } }
"""
"""Narrow screens: code blocks and long names wrap; table cells wrap between words (a number never), and a table
still too wide for the page scrolls inside its own box."""


def _image(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _inline_html(tokens: Iterable[Token]) -> str:
    tags = {"code": "code", "bold": "strong"}
    return "".join(
        f"<{tags[token.kind]}>{html.escape(token.text)}</{tags[token.kind]}>"
        if token.kind in tags
        else html.escape(token.text)
        for token in tokens
    )


def inline_markdown(text: str) -> str:
    """Escaped text with Markdown's inline code and bold (read as :func:`~lightning_vram.render.markup.advice_tokens`).

    >>> inline_markdown("use `a<b` **now**")
    'use <code>a&lt;b</code> <strong>now</strong>'
    """
    return _inline_html(advice_tokens(text))


def markdown_to_html(text: str) -> str:
    r"""The little Markdown advice uses: fenced code blocks, inline code, bold, paragraphs.

    >>> markdown_to_html("Use `x`.\n```python\nf(x)\n```")
    '<p>Use <code>x</code>.</p>\n<pre><code class="language-python">f(x)</code></pre>'
    """
    parts: list[str] = []
    paragraph: list[Token] = []

    def end_paragraph() -> None:
        if "".join(piece.text for piece in paragraph).strip():
            parts.append(f"<p>{_inline_html(paragraph).strip()}</p>")
        paragraph.clear()

    for token in advice_tokens(text):
        if token.kind != "block":
            paragraph.append(token)
            continue
        end_paragraph()
        language = html.escape(token.language or "text")
        parts.append(f'<pre><code class="language-{language}">{html.escape(token.text)}</code></pre>')
    end_paragraph()
    return "\n".join(parts)


def _advice_html(item: Advice, spread: float | None = None) -> str:
    savings = saving_text(item)
    saving = f"<p><strong>Expected saving:</strong> {html.escape(savings)}</p>" if savings else ""
    if item.cost_text is not None:
        saving += f"<p><strong>Time cost:</strong> {html.escape(item.cost_text)}</p>"
    predicted = predicted_step_text(item)
    if predicted is not None:
        saving += f"<p><strong>Step time:</strong> {html.escape(predicted)}</p>"
    if has_step_time(item) and (note := spread_note(spread)) is not None:
        saving += f"<p><strong>Timing:</strong> {html.escape(note)}</p>"
    return (
        f'<div class="advice {html.escape(item.severity)}" id="{html.escape(item.id)}">'
        f"<h3>{inline_markdown(item.title)}</h3>"
        f'<p class="meta"><code>{html.escape(item.id)}</code> · {html.escape(item.severity)}</p>'
        f"<p><strong>Evidence:</strong> {html.escape(item.evidence)}</p>{saving}{markdown_to_html(item.detail)}</div>"
    )


def table_html(table: Table, table_id: str) -> str:
    """A table of plain-text cells as HTML, every cell escaped; numeric columns aligned right."""

    def cells(values: tuple[str, ...], tag: str) -> str:
        return "".join(
            f'<{tag} class="n">{html.escape(value)}</{tag}>' if numeric else f"<{tag}>{html.escape(value)}</{tag}>"
            for value, numeric in zip(values, table.numeric, strict=True)
        )

    rows = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in table.rows)
    return scrolling(f'<table id="{table_id}"><tr>{cells(table.header, "th")}</tr>{rows}</table>')


def scrolling(table: str) -> str:
    """A table in a box of the page's width that scrolls sideways when the table is wider (a narrow screen)."""
    return f'<div class="scroll">{table}</div>'


def _not_advised_html(items: tuple[NotAdvised, ...]) -> str:
    """The remedies weighed and not advised, under their own heading (nothing without any)."""
    if not items:
        return ""
    listed = "".join(f"<li><code>{html.escape(item.id)}</code>: {html.escape(item.reason)}</li>" for item in items)
    return f'<h3>Not advised</h3><ul id="not-advised">{listed}</ul>'


def _simulation_html(report: Report) -> list[str]:
    view = simulation_view(report)
    if view is None:
        return []
    sections = ["<h2>Simulation</h2>", f"<p>{html.escape(view.summary)}</p>"]
    if view.baseline is not None:
        sections.append(table_html(view.baseline, "simulation-baseline"))
    if view.calibration is not None:
        sections.append(table_html(view.calibration, "simulation-calibration"))
    if view.variants is not None:
        sections.append(table_html(view.variants, "simulation-variants"))
    if view.notes:
        sections.append("<ul>" + "".join(f"<li>{html.escape(note)}</li>" for note in view.notes) + "</ul>")
    return sections


def render_html(report: Report, pngs: FigurePngs | None = None) -> str:
    """The whole report as a standalone HTML page: the headline and the advice first, then the measurements.

    ``pngs``: the report's figures drawn already (:func:`~lightning_vram.render.figure_set.report_pngs`); by default
    they are drawn here.
    """
    pngs = report_pngs(report) if pngs is None else pngs
    device = report.device
    sections = [
        f"<h1>VRAM report</h1><p class='headline'>{html.escape(headline(report))}</p>",
        "<p class='meta'>"
        + html.escape(
            f"{device.name} ({device.type}), capacity {capacity_text(device)}; precision {report.precision or 'n/a'};"
            f" batch size {report.batch_size or 'n/a'}; {report_steps_text(report)}; {timing_line(report)}"
        )
        + "</p>",
    ]
    if (ranks := ranks_line(report)) is not None:
        sections.append(f"<p class='headline'>{html.escape(ranks)}</p>")
    sections.append("<h2>Advice</h2>")
    if report.advice:
        sections += [_advice_html(item, report.timing.step_time_iqr_fraction) for item in report.advice]
    else:
        sections.append("<p>No advice: no rule found a change worth making in this run's measurements.</p>")
    if report.not_advised:
        sections.append(_not_advised_html(report.not_advised))
    sections.append("<h2>Breakdown at each phase's peak</h2>")
    if report.phases:
        rows = []
        for phase, peak in in_phase_order(report.phases):
            values = peak.breakdown.to_dict() if peak.breakdown is not None else {}
            cells = "".join(f'<td class="n">{format_bytes(values.get(name))}</td>' for name in CATEGORIES)
            rows.append(f'<tr><td>{phase.value}</td><td class="n">{format_bytes(peak.peak_bytes)}</td>{cells}</tr>')
        header = "".join(f'<th class="n">{name.replace("_", " ")}</th>' for name in CATEGORIES)
        sections.append(
            scrolling(
                f'<table><tr><th>phase</th><th class="n">{peak_label(report)}</th>{header}</tr>{"".join(rows)}</table>'
            )
        )
        if (instant := breakdown_instant_note(report)) is not None:
            sections.append(f"<p>{html.escape(instant)}</p>")
        if (several := several_updates_note(report)) is not None:
            sections.append(f"<p>{html.escape(several)}</p>")
        if BREAKDOWN_TAG in pngs:
            sections.append(_image(pngs[BREAKDOWN_TAG], "breakdown per phase"))
    if report.evaluation:
        sections.append(f"<p>Evaluation peaks: {html.escape(evaluation_text(report.evaluation))}.</p>")
    if MEMORY_OVER_STEPS_TAG in pngs:
        sections += ["<h2>Memory over steps</h2>", _image(pngs[MEMORY_OVER_STEPS_TAG], "memory over steps")]
    if report.modules:
        table = "".join(
            f"<tr><td><code>{html.escape(row.name)}</code></td><td>{html.escape(row.type)}</td>"
            f'<td class="n">{format_bytes(row.activation_bytes)}</td></tr>'
            for row in report.modules
        )
        sections += [
            "<h2>Modules saving the most activations</h2>",
            scrolling(
                f'<table id="modules"><tr><th>module</th><th>type</th><th class="n">saved</th></tr>{table}</table>'
            ),
        ]
        if TOP_MODULES_TAG in pngs:
            sections.append(_image(pngs[TOP_MODULES_TAG], "top modules"))
    if report.fit:
        fit = "".join(
            f'<tr><td>{html.escape(row.device)}</td><td class="n">{format_bytes(row.capacity_bytes)}</td>'
            f'<td class="n">{row.batch_text}</td><td class="n">{row.expandable_text}</td>'
            f"<td>{html.escape(row.basis)}</td></tr>"
            for row in report.fit
        )
        sections.append(
            "<h2>Largest batch of this run per GPU</h2>"
            + scrolling(
                '<table><tr><th>GPU</th><th class="n">capacity</th><th class="n">batch</th>'
                '<th class="n">with expandable_segments:True</th><th>basis</th></tr>'
                f"{fit}</table>"
            )
            + f"<p>{html.escape(fit_assumption(report.fit))}</p>"
        )
    if report.shapes is not None and shows_lengths(report.shapes):
        sections += ["<h2>Batch shapes</h2>", f"<p>{html.escape(shapes_sentence(report.shapes))}</p>"]
        if (lengths := lengths_table(report.shapes)) is not None:
            sections.append(table_html(lengths, "batch-lengths"))
    if STEP_MEMORY_TAG in pngs:
        sections += ["<h2>Memory during one step</h2>", _image(pngs[STEP_MEMORY_TAG], "memory during one step")]
    sections += _simulation_html(report)
    if report.not_measured:
        items = "".join(
            f"<li>{html.escape(item.what)}: {html.escape(item.reason)}</li>" for item in report.not_measured
        )
        sections.append(f"<h2>Not measured</h2><ul>{items}</ul>")
    body = "\n".join(sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><title>VRAM report</title>'
        f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )
