"""Rank zero's report handed back to the process that built the monitor, when fit ran in processes it spawned.

With ``strategy="ddp_spawn"`` (any start method Lightning's multiprocessing launcher uses), fit runs in child
processes, each with a copy of the callback: the monitor the user holds never sees a hook, and Lightning sends back
only its own results (weights, ``callback_metrics``). Rank zero's copy writes its report as JSON to a file named by a
token the monitor drew when it was built (the copies carry it); the monitor that built it reads the file on the first
look at its report after fit, and removes it. A file never read is removed when that monitor goes away or the
process exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.exceptions import warn
from lightning_vram.records import Report


@dataclass(frozen=True)
class HandedBack:
    """A report a spawned rank zero handed back, and where it wrote ``vram_report.json`` (``None``: nowhere)."""

    report: Report
    report_path: Path | str | None


class Handback:
    """The way back from rank zero's process to the process that built ``owner``.

    Built with the monitor; pickled with it into the processes Lightning spawns (the token and the builder's process
    id travel, nothing else).
    """

    def __init__(self, owner: object) -> None:
        self.builder = os.getpid()
        self.path = Path(tempfile.gettempdir()) / f"lightning_vram-report-{uuid.uuid4().hex}.json"
        weakref.finalize(owner, _remove, self.path)

    def in_a_copy(self) -> bool:
        """Whether this runs in another process than the one that built the monitor (a spawned or forked rank)."""
        return os.getpid() != self.builder

    def send(self, report: Report, report_path: Path | str | None) -> None:
        """Write ``report`` for the builder to read (rank zero, in a copy); a failure warns and leaves it without."""
        data = {
            "report": report_to_dict(report),
            "report_path": None if report_path is None else str(report_path),
            "local": isinstance(report_path, Path),
        }
        partial = self.path.with_suffix(".partial")
        try:
            partial.write_text(json.dumps(data), encoding="utf-8")
            partial.replace(self.path)
        except OSError as error:
            warn(
                f"VramMonitor: the report could not be handed back to the process that started fit ({error});"
                " monitor.report stays None there, the report files are written."
            )

    def receive(self) -> HandedBack | None:
        """The report rank zero handed back since the last call, read once (``None``: none, or in a copy)."""
        if self.in_a_copy():
            return None
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as error:
            _unreadable(self.path, str(error))
            return None
        finally:
            _remove(self.path)
        try:
            data = json.loads(text)
            report = report_from_dict(data["report"])
        except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError and FormatError are ValueErrors
            _unreadable(self.path, str(error))
            return None
        path = data.get("report_path")
        return HandedBack(report, Path(path) if path is not None and data.get("local") else path)


def _unreadable(path: Path, why: str) -> None:
    warn(
        f"VramMonitor: the report rank zero handed back ({path}) could not be read ({why}); monitor.report stays"
        " None here, the report files are written."
    )


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
