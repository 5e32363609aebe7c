"""A gloo rank's replay beside its measured step, as the live sharded scripts write it to ``rank<rank>.json``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_vram.records.advice import Advice
from lightning_vram.records.measured import LIVE_PEAK_PART, Phase, PhasePeak
from lightning_vram.records.simulation import BaselineMatch, PartMatch


def match_rows(match: BaselineMatch | None) -> list[list[Any]] | None:
    """The baseline's match part by part: phase, part, measured and replayed bytes; None where nothing matched."""
    if match is None:
        return None
    return [[part.phase.value, part.part, part.measured_bytes, part.replayed_bytes] for part in match.parts]


def released_late(match: BaselineMatch | None) -> dict[str, int]:
    """Of each phase's sampled live peak, the bytes gloo's worker thread freed late (phases with none left out)."""
    if match is None:
        return {}
    return {part.phase.value: part.released_late_bytes for part in match.parts if part.released_late_bytes}


def peak_error(phase: str, measured: int, replayed: int, late: Mapping[str, int]) -> float:
    """How far a replayed live peak is from the measured one, a share of it: 0 where the replay lies between the
    measured peak with and without what gloo's thread released late (``late``, :func:`released_late`'s)."""
    return PartMatch(Phase(phase), LIVE_PEAK_PART, measured, replayed, late.get(phase, 0)).relative_error


def phase_peaks(phases: Mapping[Phase, PhasePeak]) -> dict[str, int]:
    """Each phase's peak, bytes."""
    return {phase.value: peak.peak_bytes for phase, peak in phases.items()}


def advice_rows(advice: Iterable[Advice]) -> list[list[Any]]:
    """Each advice's id, saving basis, estimated saving (bytes) and detail."""
    return [[item.id, str(item.saving_basis), item.estimated_saving_bytes, item.detail] for item in advice]
