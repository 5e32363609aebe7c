"""The baseline check: a replay of a sampled step against that step's counts, part by part."""

from __future__ import annotations

from lightning_vram.records import Attribution, BaselineMatch, PartMatch, ReplayedStep

PARTS = ("parameters", "gradients", "optimizer_state", "activations")
"""The counted parts compared (``other`` is not counted on a sampled step)."""
BASELINE_TOLERANCE = 0.01
"""Each part of each phase must be within 1% of the sampled step's count before a variant is trusted."""


def match_baseline(
    replayed: ReplayedStep, attribution: Attribution, tolerance: float = BASELINE_TOLERANCE
) -> BaselineMatch:
    """Every counted part of every phase the sampled step counted, against the replay's.

    A phase the replay lacks compares as zero bytes.
    """
    parts = []
    for phase, measured in attribution.phases.items():
        peak = replayed.phases.get(phase)
        breakdown = peak.breakdown if peak is not None else None
        for part in PARTS:
            replayed_bytes = getattr(breakdown, part) if breakdown is not None else 0
            parts.append(PartMatch(phase, part, getattr(measured, part), replayed_bytes))
    return BaselineMatch(step=attribution.step, parts=tuple(parts), tolerance=tolerance)


def mismatch_reason(match: BaselineMatch) -> str:
    """Why a baseline that does not match is not trusted, naming the part furthest off."""
    worst = match.worst
    if worst is None:
        return "the sampled step counted no phase to compare the replay with"
    return (
        f"the replay does not reproduce sampled step {match.step}: {worst.phase.value} {worst.part} replayed"
        f" {worst.replayed_bytes} bytes, counted {worst.measured_bytes} (more than {match.tolerance:.0%} apart)"
    )
