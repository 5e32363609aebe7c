"""What the monitor knew when a CUDA out-of-memory error ended training: the diagnosis, its headline, its JSON form.

The JSON form is schema ``lightning_vram.oom_report/1``, written to ``vram_oom_report.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightning_vram.records.advice import Advice
from lightning_vram.records.advice_json import advice_to_dict
from lightning_vram.records.measured import Breakdown, PhasePeak
from lightning_vram.records.measured_json import breakdown_to_dict, phase_peak_to_dict
from lightning_vram.units import format_bytes

OOM_SCHEMA = "lightning_vram.oom_report/1"


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
        return oom_headline(self)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form, as written to ``vram_oom_report.json``."""
        return {
            "schema": OOM_SCHEMA,
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
            "breakdown": breakdown_to_dict(self.breakdown),
            "last_good_step": [phase_peak_to_dict(peak) for peak in self.last_good_step],
            "advice": [advice_to_dict(item) for item in self.advice],
            "notes": list(self.notes),
            "snapshot": str(self.snapshot) if self.snapshot is not None else None,
        }


def oom_headline(diagnosis: OomDiagnosis) -> str:
    """One line: what was needed, where, and what held the most."""
    more = diagnosis.needed_more_bytes
    if more is not None:
        need = f"needed {format_bytes(more)} more"
    elif diagnosis.message.tried_bytes is not None:
        need = f"tried to allocate {format_bytes(diagnosis.message.tried_bytes)}"
    else:
        need = "ran out of memory"
    text = f"{need} in {diagnosis.where} of step {diagnosis.step}"
    if diagnosis.breakdown is not None:
        largest = diagnosis.breakdown.largest_part
        text += f"; {largest.replace('_', ' ')} held {format_bytes(diagnosis.breakdown.to_dict()[largest])}"
    return text
