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
from lightning_vram.render.text import advice_line, headline, summary_text
from lightning_vram.units import format_bytes

SHORT_LABELS = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_state": "optimizer",
    "activations": "activations",
    "other": "other",
}
"""Column labels that fit an 80-column terminal."""


def _rich_summary(report: Report, stream: TextIO) -> bool:
    """Print the summary with rich; ``False`` when rich is not installed."""
    try:
        console_module = importlib.import_module("rich.console")
        table_module = importlib.import_module("rich.table")
        text_module = importlib.import_module("rich.text")
    except ImportError:
        return False
    console = console_module.Console(file=stream)
    device = report.device
    table = table_module.Table(
        title=text_module.Text(f"VRAM: {headline(report)}"),
        caption=text_module.Text(printable(f"{device.name} ({device.type}), {report.steps} steps")),
        title_justify="left",
    )
    table.add_column("phase")
    table.add_column("peak", justify="right")  # the title's headline says which peak: the table fits 80 columns
    for name in CATEGORIES:
        table.add_column(SHORT_LABELS[name], justify="right")
    for phase, peak in in_phase_order(report.phases):
        values = peak.breakdown.to_dict() if peak.breakdown is not None else {}
        table.add_row(
            phase.value, format_bytes(peak.peak_bytes), *(format_bytes(values.get(name)) for name in CATEGORIES)
        )
    console.print(table)
    for advice in report.advice:
        console.print(printable(f"  {advice_line(advice)}"), markup=False, highlight=False)
    return True


def print_summary(report: Report, stream: TextIO | None = None) -> None:
    """A table of the phases and the advice titles on a terminal (with rich), else :func:`summary_text`."""
    out = stream if stream is not None else sys.stdout
    if out.isatty() and _rich_summary(report, out):
        return
    print(summary_text(report), file=out)
