"""The views as a user reads them: whole steps on step axes, no empty parts in labels, a page that fits a phone."""

from __future__ import annotations

import importlib.util
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from sessions import plain_run

from lightning_vram.records import Advice, AdviceId, BatchShapes, LengthPeak, ModuleProfile, Severity, StepPoint
from lightning_vram.records.report import RankSummary
from lightning_vram.records.shapes import TensorShapes
from lightning_vram.render.figures import memory_over_steps_figure, modules_figure
from lightning_vram.render.html import STYLE, render_html, table_html
from lightning_vram.render.shapes import lengths_line, lengths_table, shapes_sentence
from lightning_vram.render.simulation import Table
from lightning_vram.render.text import module_text, ranks_line, summary_text

ROOT = Path(__file__).resolve().parent.parent


def test_the_step_axis_ticks_whole_steps() -> None:
    figure = memory_over_steps_figure([StepPoint(step, 1024 * step) for step in (1, 2, 3)], None)
    figure.canvas.draw()  # matplotlib places ticks when drawn
    low, high = figure.axes[0].get_xlim()
    ticks = [tick for tick in figure.axes[0].get_xticks() if low <= tick <= high]
    assert len(ticks) >= 2 and all(float(tick).is_integer() for tick in ticks)


def test_fewer_than_three_steps_are_said_not_plotted() -> None:
    one = memory_over_steps_figure([StepPoint(2, 3 * 1024**2)], "8.00 GiB")
    assert one.axes == []  # no axis labelled 1.900 to 2.100 around one point
    assert [text.get_text() for text in one.texts] == [
        "Peak memory of each step",
        "Only 1 step measured (step 2: 3.0 MiB): a line needs 3 or more.",
    ]
    two = memory_over_steps_figure([StepPoint(2, 1024), StepPoint(7, 2048)], None)
    assert two.axes == [] and two.texts[1].get_text() == (
        "Only 2 steps measured (step 2: 1.0 KiB, step 7: 2.0 KiB): a line needs 3 or more."
    )
    three = memory_over_steps_figure([StepPoint(step, 1024 * step) for step in (1, 2, 3)], None)
    assert list(three.axes[0].lines[0].get_xdata()) == [1, 2, 3]


def test_on_the_cpu_too_few_steps_say_how_to_sample_more() -> None:
    """A new user's trial: a 30-step CPU run's figure said only "Only 1 step measured ... a line needs 3 or more"."""
    sampled = memory_over_steps_figure([StepPoint(2, 3 * 1024**2)], None, sampled_only=True)
    assert sampled.texts[1].get_text() == (
        "Only 1 step measured (step 2: 3.0 MiB): a line needs 3 or more. On the CPU only sampled steps are measured:"
        " VramMonitor(attribution_every_n_steps=N) samples every Nth."
    )


def test_a_module_without_a_type_is_named_without_empty_parentheses() -> None:
    rows = (ModuleProfile("head", "Linear", 2048), ModuleProfile("(training_step)", "-", 1024))
    assert [module_text(row) for row in rows] == ["head (Linear)", "(training_step)"]
    labels = [label.get_text() for label in modules_figure(rows).axes[0].get_yticklabels()]
    assert labels == ["(training_step)", "head (Linear)"]  # largest on top


def test_the_page_fits_a_narrow_screen() -> None:
    assert re.search(r"pre \{[^}]*white-space: pre-wrap; overflow-wrap: anywhere", STYLE)
    assert re.search(r"\.scroll \{ max-width: 100%; overflow-x: auto; \}", STYLE)
    table = table_html(Table(("a", "b"), (False, True), (("x", "1"),)), "t")
    assert table.startswith('<div class="scroll"><table id="t">') and table.endswith("</table></div>")


def test_every_table_of_a_report_scrolls_in_its_own_box() -> None:
    session = plain_run(None)
    assert session.report is not None
    page = render_html(session.report)
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    assert page.count("<table") == page.count('<div class="scroll"><table')
    assert "(training_step) (-)" not in summary_text(session.report)


def test_the_console_says_where_to_read_how_to_apply_the_advice() -> None:
    """A new user's trial: the console led with each advice's title, and nothing said where its code was."""
    session = plain_run(None)
    report = session.report
    assert report is not None
    advice = Advice(AdviceId.LARGE_LINEAR, Severity.INFO, "Split the head", "the code", "evidence", 2048)
    where = "how to apply the advice (the code to change, the evidence): vram_report.md"
    assert where in summary_text(replace(report, advice=(advice,)), details="vram_report.md", width=200)
    assert where not in summary_text(replace(report, advice=()), details="vram_report.md", width=200)


def test_the_license_is_the_apache_text_and_the_metadata_names_it() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    project = (ROOT / "pyproject.toml").read_text()
    assert '\nlicense = "Apache-2.0"\nlicense-files = ["LICENSE"]\n' in project


def _check_views() -> Any:
    spec = importlib.util.spec_from_file_location("check_views", ROOT / "scripts" / "check_views.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_check_views_writes_to_a_temporary_folder_unless_told(tmp_path: Path) -> None:
    script = _check_views()
    default = script.arguments_of([]).out
    assert default.is_dir() and not any(default.iterdir())  # new and empty: the README's pictures stay
    assert default.parent == Path(tempfile.gettempdir()) and default.name.startswith("check_views-")
    default.rmdir()
    assert script.arguments_of(["page.html", "--out", str(tmp_path)]).out == tmp_path


def test_shapes_name_an_image_s_channels_and_a_sequence_s_length() -> None:
    images = TensorShapes("batch[0]", (8, 3, 64, 64), (8, 4, 64, 64))
    shapes = BatchShapes(
        (images,), 3, 8 * 4 * 64 * 64, lengths=(LengthPeak(4, 2048, 3),), length_counts=((3, 5), (4, 1))
    )
    assert shapes_sentence(shapes) == (
        "Batch shapes varied (batch[0] channels (dim 1): 3-4); the largest batch (131,072 elements) was step 3's."
        " 95% of the batches had channels at most 4 (the largest 4)."
    )
    assert lengths_line(shapes) == "peak per channels: 4: 2.0 KiB"
    table = lengths_table(shapes)
    assert table is not None and table.header[0] == "channels"
    tokens = TensorShapes("batch['input_ids']", (8, 128), (8, 512))
    assert lengths_line(replace(shapes, tensors=(tokens,))) == "peak per length: 4: 2.0 KiB"


def test_ranks_that_peaked_alike_are_said_to_in_one_figure() -> None:
    """A new user's trial: two DDP ranks at the same peak read "rank 0 peaked highest (49.3 MiB), 0 B above rank 0"."""
    report = plain_run(None).report
    assert report is not None
    alike = (RankSummary(0, None, 3 * 1024**2, 4), RankSummary(1, None, 3 * 1024**2, 4))
    assert ranks_line(replace(report, ranks=alike)) == "2 ranks: every rank peaked at 3.0 MiB"
    apart = (RankSummary(0, None, 3 * 1024**2, 4), RankSummary(1, None, 4 * 1024**2, 4))
    assert ranks_line(replace(report, ranks=apart)) == "2 ranks: rank 1 peaked highest (4.0 MiB), 1.0 MiB above rank 0"
