"""Out-of-memory diagnosis: where the run died, what it asked for, what held the memory, and what to change."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_vram.advice import Advice, RunSummary, TrainingSetup, advise, evaluation_batch_size
from lightning_vram.records import AllocatorReading, Breakdown, Phase, PhasePeak
from lightning_vram.report import advice_markdown, advice_to_dict
from lightning_vram.units import format_bytes

JSON_STEM = "vram_oom_report"
SNAPSHOT_STEM = "vram_oom_snapshot"
_UNITS = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
_FIELDS = {
    "tried_bytes": rf"Tried to allocate {_SIZE}",
    "capacity_bytes": rf"total capacity of {_SIZE}",
    "free_bytes": rf"of which {_SIZE} is free",
    "process_bytes": rf"this process has {_SIZE} memory in use",
    "allocated_bytes": rf"{_SIZE} is allocated by PyTorch",
    "reserved_unallocated_bytes": rf"{_SIZE} is reserved by PyTorch but unallocated",
}


@dataclass(frozen=True)
class OomMessage:
    """The figures in torch's CUDA out-of-memory message, in bytes (rounded as torch prints them).

    Each is ``None`` when the message does not carry it (older torch versions, other allocators).
    """

    tried_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None


def parse_size(number: str, unit: str) -> int:
    """Bytes of a size as torch prints it.

    >>> parse_size("1.50", "GiB")
    1610612736
    """
    return round(float(number) * _UNITS[unit])


def parse_oom_message(text: str) -> OomMessage:
    """Read the figures out of a CUDA out-of-memory message.

    >>> parse_oom_message("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    ...                   "8.00 GiB of which 0 bytes is free.").tried_bytes
    20971520
    """
    values: dict[str, int] = {}
    for field, pattern in _FIELDS.items():
        match = re.search(pattern, text)
        if match is not None:
            values[field] = parse_size(match.group(1), match.group(2))
    return OomMessage(**values)


@dataclass(frozen=True)
class OomDiagnosis:
    """What the monitor knew when a CUDA out-of-memory error ended training, on one rank.

    ``where`` is ``forward``, ``backward``, ``optimizer`` or ``validation``; sizes are bytes. ``allocated_bytes``
    and ``reserved_bytes`` come from torch's message when it has them, else from the allocator's last reading.
    ``breakdown`` is at the failure: model state counted then, activations from the last sampled step.
    """

    where: str
    step: int
    rank: int
    message: OomMessage
    capacity_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    breakdown: Breakdown | None
    last_good_step: tuple[PhasePeak, ...]
    advice: tuple[Advice, ...]
    notes: tuple[str, ...]
    snapshot: Path | None

    @property
    def needed_more_bytes(self) -> int | None:
        """How much more the failing allocation needed than the device had free."""
        tried, free = self.message.tried_bytes, self.message.free_bytes
        if tried is None or free is None:
            return None
        return max(tried - free, 0)

    def headline(self) -> str:
        """One line: what was needed, where, and what held the most."""
        more = self.needed_more_bytes
        if more is not None:
            need = f"needed {format_bytes(more)} more"
        elif self.message.tried_bytes is not None:
            need = f"tried to allocate {format_bytes(self.message.tried_bytes)}"
        else:
            need = "ran out of memory"
        text = f"{need} in {self.where} of step {self.step}"
        if self.breakdown is not None:
            parts = {name: value for name, value in self.breakdown.to_dict().items() if value is not None}
            largest = max(parts, key=lambda name: parts[name])
            text += f"; {largest.replace('_', ' ')} held {format_bytes(parts[largest])}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as written to ``vram_oom_report.json``."""
        return {
            "schema": "lightning_vram.oom_report/1",
            "headline": self.headline(),
            "where": self.where,
            "step": self.step,
            "rank": self.rank,
            "tried_bytes": self.message.tried_bytes,
            "free_bytes": self.message.free_bytes,
            "needed_more_bytes": self.needed_more_bytes,
            "capacity_bytes": self.capacity_bytes,
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "process_bytes": self.message.process_bytes,
            "breakdown": self.breakdown.to_dict() if self.breakdown is not None else None,
            "last_good_step": [
                {"step": peak.step, "phase": peak.phase.value, "peak_bytes": peak.peak_bytes}
                for peak in self.last_good_step
            ],
            "advice": [advice_to_dict(item) for item in self.advice],
            "notes": list(self.notes),
            "snapshot": str(self.snapshot) if self.snapshot is not None else None,
        }

    def markdown(self) -> str:
        """The diagnosis as Markdown; its first line is the headline."""
        lines = [
            f"# Out of memory: {self.headline()}",
            "",
            f"Rank {self.rank}. Tried to allocate {format_bytes(self.message.tried_bytes)} with"
            f" {format_bytes(self.message.free_bytes)} free of {format_bytes(self.capacity_bytes)};"
            f" allocated {format_bytes(self.allocated_bytes)}, reserved {format_bytes(self.reserved_bytes)}.",
        ]
        if self.breakdown is not None:
            lines += ["", "| at the failure | bytes |", "|---|---:|"]
            lines += [
                f"| {name.replace('_', ' ')} | {format_bytes(value)} |"
                for name, value in self.breakdown.to_dict().items()
            ]
        if self.last_good_step:
            peaks = ", ".join(f"{peak.phase.value} {format_bytes(peak.peak_bytes)}" for peak in self.last_good_step)
            lines += ["", f"Last good step ({self.last_good_step[0].step}): {peaks}."]
        lines += ["", "## What to change, largest saving first", "", advice_markdown(self.advice).rstrip()]
        if self.notes or self.snapshot is not None:
            lines += ["", "## Notes", ""] + [f"- {note}" for note in self.notes]
            if self.snapshot is not None:
                lines.append(f"- Allocator history: `{self.snapshot}`; open it at https://pytorch.org/memory_viz")
        return "\n".join(lines) + "\n"


def diagnose(
    *,
    error_text: str,
    where: str,
    step: int,
    rank: int,
    model_state: Breakdown,
    last_reading: AllocatorReading | None,
    summary: RunSummary,
    setup: TrainingSetup,
    notes: tuple[str, ...],
    snapshot: Path | None,
) -> OomDiagnosis:
    """Put together what was known when the error came.

    ``model_state`` holds the parts counted at the failure (``other`` unset); ``summary`` is the run so far. The
    advice is the run's own, judged as if the failing step had reached what it asked for (allocated + the failed
    request), largest saving first; validation failures get ``evaluation-batch-size`` first.
    """
    message = parse_oom_message(error_text)
    allocated = message.allocated_bytes
    if allocated is None and last_reading is not None:
        allocated = last_reading.allocated_bytes
    reserved = (
        message.allocated_bytes + message.reserved_unallocated_bytes
        if message.allocated_bytes is not None and message.reserved_unallocated_bytes is not None
        else (last_reading.reserved_bytes if last_reading is not None else None)
    )
    capacity = message.capacity_bytes or summary.device.total_bytes
    breakdown = model_state.with_measured_peak(allocated) if allocated is not None else model_state
    phase = next((candidate for candidate in Phase if candidate.value == where), None)
    judged = summary
    if phase is not None and allocated is not None:
        need = allocated + (message.tried_bytes or 0)
        failing = PhasePeak(step, phase, need, reserved, model_state.with_measured_peak(need))
        judged = replace(summary, peak=failing, device=replace(summary.device, total_bytes=capacity))
    advice = sorted(advise(judged, setup), key=lambda item: -(item.estimated_saving_bytes or 0))
    if where == "validation":
        advice.insert(0, evaluation_batch_size(step, summary.peak))
    return OomDiagnosis(
        where=where,
        step=step,
        rank=rank,
        message=message,
        capacity_bytes=capacity,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        breakdown=breakdown,
        last_good_step=summary.last_step,
        advice=tuple(advice),
        notes=notes,
        snapshot=snapshot,
    )


def report_stem(stem: str, rank: int, world_size: int) -> str:
    """File stem for this rank: plain for one process, ``.rankN`` under distributed training.

    >>> report_stem("vram_oom_report", 1, 4), report_stem("vram_oom_report", 0, 1)
    ('vram_oom_report.rank1', 'vram_oom_report')
    """
    return f"{stem}.rank{rank}" if world_size > 1 else stem


def write_diagnosis(diagnosis: OomDiagnosis, directory: Path, world_size: int) -> Path:
    """Write ``vram_oom_report[.rankN].json`` and ``.md`` into ``directory``; returns the JSON's path."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = report_stem(JSON_STEM, diagnosis.rank, world_size)
    path = directory / f"{stem}.json"
    path.write_text(json.dumps(diagnosis.to_dict(), indent=2) + "\n", encoding="utf-8")
    (directory / f"{stem}.md").write_text(diagnosis.markdown(), encoding="utf-8")
    return path
