"""``lightning-vram``: show, render or compare the reports a VramMonitor wrote.

    lightning-vram show PATH            the summary of a report (PATH: vram_report.json or the log dir holding it)
    lightning-vram html PATH -o FILE    the report as a standalone HTML page
    lightning-vram diff A B             what changed from run A to run B: peak, each part, advice

A missing path or a file that is not a report prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_vram.codec import CATEGORIES, FormatError, in_phase_order, report_from_dict
from lightning_vram.records import Report
from lightning_vram.render.files import JSON_FILENAME
from lightning_vram.render.html import render_html
from lightning_vram.render.text import summary_text
from lightning_vram.units import format_bytes

USAGE_ERROR = 2
MAX_REPORT_BYTES = 64 * 1024**2
"""A report is a few hundred KiB at most; a larger file is not one, and is not read into memory."""


class CommandError(Exception):
    """A problem with the user's input, reported in one line."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _read_text(path: Path) -> str:
    """The file's text: a regular file of at most :data:`MAX_REPORT_BYTES`, in UTF-8."""
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode):
            raise CommandError(f"{path}: not a regular file")
        if status.st_size > MAX_REPORT_BYTES:
            raise CommandError(f"{path}: {format_bytes(status.st_size)} is too large for a report")
        with path.open("rb") as file:
            data = file.read(MAX_REPORT_BYTES + 1)
    except FileNotFoundError as error:
        raise CommandError(f"{path}: no such file or directory") from error
    except OSError as error:
        raise CommandError(f"{path}: {error.strerror or error}") from error
    if len(data) > MAX_REPORT_BYTES:
        raise CommandError(f"{path}: too large for a report")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CommandError(f"{path}: not UTF-8 text (byte {error.start})") from error


def load_report(path: Path) -> Report:
    """The report at ``path``: a ``vram_report.json`` or a directory holding one (searched below it)."""
    if path.is_dir():
        found = sorted(path.rglob(JSON_FILENAME), key=lambda candidate: candidate.stat().st_mtime)
        if not found:
            raise CommandError(f"{path}: no {JSON_FILENAME} in this directory or below it")
        path = found[-1]
    text = _read_text(path)
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise CommandError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from error
    except ValueError as error:  # Infinity/NaN, or an integer too long to convert
        raise CommandError(f"{path}: not a report ({error})") from error
    except RecursionError as error:
        raise CommandError(f"{path}: not a report (nested too deeply)") from error
    try:
        return report_from_dict(data)
    except FormatError as error:
        raise CommandError(f"{path}: {error}") from error


def _change(before: int | None, after: int | None) -> str:
    if before is None or after is None:
        return f"{format_bytes(before)} -> {format_bytes(after)}"
    delta = after - before
    sign = "+" if delta >= 0 else "-"
    relative = f" ({sign}{abs(delta) / before:.1%})" if before else ""
    return f"{format_bytes(before)} -> {format_bytes(after)}: {sign}{format_bytes(abs(delta))}{relative}"


def diff_text(before: Report, after: Report) -> str:
    """Peak, each part at the peak, each phase's peak, and advice added and removed, from ``before`` to ``after``."""
    lines = [f"peak: {_change(_peak(before), _peak(after))}"]
    parts_before = before.peak.breakdown.to_dict() if before.peak and before.peak.breakdown else {}
    parts_after = after.peak.breakdown.to_dict() if after.peak and after.peak.breakdown else {}
    for name in CATEGORIES:
        lines.append(f"  {name.replace('_', ' ')}: {_change(parts_before.get(name), parts_after.get(name))}")
    phases_after = dict(in_phase_order(after.phases))
    for phase, peak in in_phase_order(before.phases):
        other = phases_after.get(phase)
        lines.append(f"  {phase.value} peak: {_change(peak.peak_bytes, other.peak_bytes if other else None)}")
    ids_before = {item.id for item in before.advice}
    ids_after = {item.id for item in after.advice}
    lines += [f"advice removed: {advice_id}" for advice_id in sorted(ids_before - ids_after)]
    lines += [f"advice added: {advice_id}" for advice_id in sorted(ids_after - ids_before)]
    if ids_before == ids_after:
        lines.append("advice: unchanged")
    return "\n".join(lines)


def _peak(report: Report) -> int | None:
    return report.peak.peak_bytes if report.peak is not None else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-vram", description="Show, render or compare VRAM reports.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print the summary of a report")
    show.add_argument("path", type=Path, help="vram_report.json, or a log dir holding one")
    page = commands.add_parser("html", help="render a report as a standalone HTML page")
    page.add_argument("path", type=Path, help="vram_report.json, or a log dir holding one")
    page.add_argument("-o", "--output", type=Path, required=True, help="the HTML file to write")
    diff = commands.add_parser("diff", help="compare two runs' reports")
    diff.add_argument("before", type=Path)
    diff.add_argument("after", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0, or 2 for bad input)."""
    arguments = _parser().parse_args(argv)
    try:
        if arguments.command == "show":
            print(summary_text(load_report(arguments.path)))
        elif arguments.command == "html":
            page = render_html(load_report(arguments.path))
            try:
                arguments.output.write_text(page, encoding="utf-8")
            except OSError as error:
                raise CommandError(f"{arguments.output}: {error.strerror}") from error
            print(f"wrote {arguments.output}")
        else:
            print(diff_text(load_report(arguments.before), load_report(arguments.after)))
    except CommandError as error:
        print(f"lightning-vram: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
