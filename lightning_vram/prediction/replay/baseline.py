"""The baseline check: a replay of a sampled step against that step's counts, part by part, and its live peak."""

from __future__ import annotations

from collections.abc import Mapping

from lightning_vram.records import (
    COUNTED_PARTS,
    LIVE_PEAK_PART,
    Attribution,
    BaselineMatch,
    PartMatch,
    Phase,
    PhasePeak,
    ReplayedStep,
)

BASELINE_TOLERANCE = 0.01
"""Each part of each phase must be within 1% of the sampled step's count before a variant is trusted."""


def match_baseline(
    replayed: ReplayedStep,
    attribution: Attribution,
    tolerance: float = BASELINE_TOLERANCE,
    released_late: Mapping[Phase, int] | None = None,
) -> BaselineMatch:
    """Every counted part of every phase the sampled step counted, against the replay's.

    Where the sampled step also counted every live tensor (its breakdowns carry ``other``: the CPU), each phase's
    live peak is compared with the replay's too, so that savings read as live-peak differences rest on a replay
    that reproduces the live peak. A phase the replay lacks compares as zero bytes. ``released_late``: of each live
    peak, the bytes another thread freed after the step's code had let go of them (gloo's worker thread): the replay
    matches a peak it reproduces with or without them (:attr:`~lightning_vram.records.PartMatch.released_late_bytes`).

    Under gradient accumulation a sampled step is one micro-batch: one with an optimizer step, or a later one of its
    window, is compared with the replay's :attr:`~lightning_vram.records.ReplayedStep.phases` (a later micro-batch,
    whose backward adds to the gradients); one without, that does not match them, with the window's first
    (:attr:`~lightning_vram.records.ReplayedStep.window_first`: its gradients set to ``None`` before backward). The
    sampled micro-batch's place in its window is thus read from its counts, not from its index (an epoch whose
    length is not a multiple of the window moves it).
    """
    late = released_late or {}
    match = _match_phases(replayed, replayed.phases, attribution, tolerance, late)
    if match.matches or replayed.window_first is None or Phase.OPTIMIZER in attribution.phases:
        return match
    first = _match_phases(replayed, replayed.window_first, attribution, tolerance, late, window_first=True)
    return first if first.matches else match


def _match_phases(
    replayed: ReplayedStep,
    phases: Mapping[Phase, PhasePeak],
    attribution: Attribution,
    tolerance: float,
    released_late: Mapping[Phase, int],
    window_first: bool = False,
) -> BaselineMatch:
    parts = []
    for phase, measured in attribution.phases.items():
        peak = phases.get(phase)
        breakdown = peak.breakdown if peak is not None else None
        for part in COUNTED_PARTS:
            replayed_bytes = getattr(breakdown, part) if breakdown is not None else 0
            parts.append(PartMatch(phase, part, getattr(measured, part), replayed_bytes))
        if measured.other is not None:
            live = replayed.reported_bytes(peak) if peak is not None else 0
            parts.append(PartMatch(phase, LIVE_PEAK_PART, measured.peak_bytes, live, released_late.get(phase, 0)))
    return BaselineMatch(attribution.step, tuple(parts), tolerance, window_first)


def mismatch_reason(match: BaselineMatch) -> str:
    """Why a baseline that does not match is not trusted, naming the part furthest off."""
    worst = match.worst
    if worst is None:
        return "the sampled step counted no phase to compare the replay with"
    late = f", {worst.released_late_bytes} of them freed late by another thread" if worst.released_late_bytes else ""
    return (
        f"the replay does not reproduce sampled step {match.step}: {worst.phase.value} {worst.part.replace('_', ' ')}"
        f" replayed {worst.replayed_bytes} bytes, measured {worst.measured_bytes}{late} (more than"
        f" {match.tolerance:.0%} apart)"
    )
