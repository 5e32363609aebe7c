"""The end-of-training summary on the console: a rich table on a terminal, plain text elsewhere or without rich.

Everything printed through rich is a ``Text`` or printed with ``markup=False``: a device or module name holding
``[...]`` is shown as it is, never read as rich markup.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from typing import TextIO

from lightning_vram.records import CATEGORIES, Report, in_phase_order
from lightning_vram.render.text import (
    DETAILS,
    SUMMARY_TOP_MODULES,
    SUMMARY_WIDTH,
    fact_lines,
    lead_lines,
    peak_label,
    summary_text,
)
from lightning_vram.units import format_bytes


def _rich_summary(report: Report, stream: TextIO, written_to: str | None, details: str) -> bool:
    """Print the summary with rich; ``False`` when rich is not installed.

    The lines above and below the table are the plain text's (:func:`~lightning_vram.render.text.lead_lines`,
    :func:`~lightning_vram.render.text.fact_lines`), cut to the terminal's width, so it says everything
    :func:`~lightning_vram.render.text.summary_text` says; the table has a row per part and a column per phase
    (four columns: no header is cut at 80 columns).
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
    width = console.width
    for line in lead_lines(report, width, details):
        console.print(text_module.Text(line), soft_wrap=True)  # cut to the width already, escaped
    console.print(table)
    for line in fact_lines(report, SUMMARY_TOP_MODULES, written_to, width, details):
        console.print(text_module.Text(line), soft_wrap=True)
    return True


def print_summary(
    report: Report, stream: TextIO | None = None, written_to: str | None = None, details: str = DETAILS
) -> None:
    """A table of the phases and the summary's lines on a terminal (with rich), else :func:`summary_text`.

    ``written_to``: where the report's files were written, said last (``None``: not said). ``details``: the file
    the reasons for what was not advised or not measured are in. Lines are cut to the terminal's width, or to
    :data:`~lightning_vram.render.text.SUMMARY_WIDTH` characters where the output is not a terminal.
    """
    out = stream if stream is not None else sys.stdout
    if out.isatty():
        if _rich_summary(report, out, written_to, details):
            return
        width = shutil.get_terminal_size((SUMMARY_WIDTH, 24)).columns
    else:
        width = SUMMARY_WIDTH
    print(summary_text(report, written_to=written_to, width=width, details=details), file=out)
