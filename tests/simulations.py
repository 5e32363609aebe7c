"""Hand-built step replays and simulations for the advice tests: a baseline step, its replayed and discarded changes."""

from __future__ import annotations

from typing import Any

from advice_summaries import HEALTHY_BREAKDOWN, blocks, healthy_summary

from lightning_vram.records import (
    Breakdown,
    Phase,
    PhasePeak,
    ReplayedStep,
    RunSummary,
    Simulation,
    StepChange,
    VariantResult,
)

GIB = 1024**3
MIB = 1024**2
BROKEN = "RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation"


def step(
    forward: int,
    backward: int,
    optimizer: int = 4 * GIB,
    *,
    breakdowns: dict[Phase, Breakdown] | None = None,
    loss_bytes: int = 0,
    device: str = "cuda",
) -> ReplayedStep:
    """A replayed step of step 5 with these allocator peaks per phase."""
    given = breakdowns or {}
    peaks = {Phase.FORWARD: forward, Phase.BACKWARD: backward, Phase.OPTIMIZER: optimizer}
    phases = {
        phase: PhasePeak(5, phase, total, None, given.get(phase, HEALTHY_BREAKDOWN)) for phase, total in peaks.items()
    }
    return ReplayedStep(device, "32-true", 32, phases, (), loss_bytes, 0.25)


BASELINE = step(7 * GIB, 8 * GIB)
"""The healthy summary's step, replayed: 7, 8 and 4 GiB, the peak in backward."""


def simulated(*variants: VariantResult, baseline: ReplayedStep = BASELINE, **fields: Any) -> Simulation:
    return Simulation(baseline.device_type, baseline, None, None, variants, 1.5, **fields)


def replayed(change: StepChange, peak_bytes: int, phase: Phase = Phase.BACKWARD) -> VariantResult:
    """``change`` replayed with its peak ``peak_bytes`` in ``phase``; the other phases 1 GiB lower at most."""
    others = {Phase.FORWARD: peak_bytes - GIB, Phase.BACKWARD: peak_bytes - GIB, Phase.OPTIMIZER: 4 * GIB}
    others[phase] = peak_bytes
    return VariantResult(
        change, step(others[Phase.FORWARD], others[Phase.BACKWARD], min(others[Phase.OPTIMIZER], peak_bytes))
    )


def discarded(change: StepChange, reason: str = BROKEN) -> VariantResult:
    return VariantResult(change, None, reason)


def checkpoint_summary() -> RunSummary:
    # Four 750 MiB blocks with 64 MiB inputs: the modelled best plan frees (3000 - 942) MiB of the 8 GiB peak.
    return healthy_summary(modules=blocks(4, 750 * MIB, 64 * MIB))
