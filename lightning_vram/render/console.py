"""The end-of-training summary on the console: a rich table on a terminal, plain text elsewhere or without rich.

Everything printed through rich is a ``Text`` or printed with ``markup=False``: a device or module name holding
``[...]`` is shown as it is, never read as rich markup.
"""

from __future__ import annotations

import importlib
import sys
from typing import TextIO

from lightning_vram.records import CATEGORIES, Report, in_phase_order
from lightning_vram.render.markup import printable
from lightning_vram.render.text import (
    SUMMARY_TOP_MODULES,
    device_line,
    fact_lines,
    headline,
    peak_label,
    ranks_line,
    summary_text,
)
from lightning_vram.units import format_bytes


def _rich_summary(report: Report, stream: TextIO, written_to: str | None) -> bool:
    """Print the summary with rich; ``False`` when rich is not installed.

    The lines above and below the table are the plain text's (:func:`~lightning_vram.render.text.fact_lines`), so
    it says everything :func:`~lightning_vram.render.text.summary_text` says; the table has a row per part and a
    column per phase (four columns: no header is cut at 80 columns).
    """
    try:
        console_module = importlib.import_module("rich.console")
        table_module = importlib.import_module("rich.table")
        text_module = importlib.import_module("rich.text")
    except ImportError:
        return False
    console = console_module.Console(file=stream)
    phases = in_phase_order(report.phases)
    table = table_module.Table()
    table.add_column("at each phase's peak", no_wrap=True)
    for phase, _ in phases:
        table.add_column(phase.value, justify="right", no_wrap=True)
    table.add_row(peak_label(report), *(format_bytes(peak.peak_bytes) for _, peak in phases))
    for name in CATEGORIES:
        values = [peak.breakdown.to_dict()[name] if peak.breakdown is not None else None for _, peak in phases]
        table.add_row(name.replace("_", " "), *(format_bytes(value) for value in values))
    ranks = [ranks] if (ranks := ranks_line(report)) is not None else []
    above = [f"VRAM report: {device_line(report)}", f"  {headline(report)}", *(f"  {line}" for line in ranks)]
    below = [f"  {line}" for line in fact_lines(report, SUMMARY_TOP_MODULES, written_to)]
    for line in above:
        console.print(text_module.Text(printable(line)), soft_wrap=True)  # the terminal wraps a long line itself
    console.print(table)
    for line in below:
        console.print(text_module.Text(printable(line)), soft_wrap=True)
    return True


def print_summary(report: Report, stream: TextIO | None = None, written_to: str | None = None) -> None:
    """A table of the phases and the summary's lines on a terminal (with rich), else :func:`summary_text`.

    ``written_to``: where the report's files were written, said last (``None``: not said).
    """
    out = stream if stream is not None else sys.stdout
    if out.isatty() and _rich_summary(report, out, written_to):
        return
    print(summary_text(report, written_to=written_to), file=out)
