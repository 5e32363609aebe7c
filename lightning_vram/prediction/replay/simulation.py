"""A run's sampled step replayed, checked against its counts, and each candidate change tried on it.

The entry point the monitor calls once a sampled step has been counted: :func:`simulate`. Nothing is trusted
before the baseline matches; each change is then replayed within the time budget, and one that raises (a
checkpointing plan that breaks backward, an optimizer that cannot run in that precision) is discarded with the
reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.baseline import BASELINE_TOLERANCE, match_baseline, mismatch_reason
from lightning_vram.prediction.replay.calibration import calibrate, carry
from lightning_vram.records import (
    Attribution,
    Calibration,
    Phase,
    PhasePeak,
    ReplayedStep,
    ReplaySkipped,
    Simulation,
    StepChange,
    VariantResult,
)
from lightning_vram.records.simulation import NOT_REPLAYED

BUDGET_RAN_OUT = "the replay budget ran out"
"""Why a change, or a fit table's row, is missing when the time budget ended first."""


class Replays(Protocol):
    """Replays of one step that share everything but their change: what the simulation and the fit table ask.

    :class:`~lightning_vram.prediction.predictor.Predictor` is the one there is.
    """

    batch: Any
    """The batch replayed."""
    budget_seconds: float | None
    """Host seconds for all the replays (``None``: no limit)."""
    calibration: Attribution | None
    """The sampled step's counts, or ``None``."""
    released_late: Callable[[], Mapping[Phase, int]]
    """Of each of the sampled step's live peaks, the bytes another thread freed late, read when the baseline is set
    against the step (:attr:`~lightning_vram.prediction.predictor.Predictor.released_late`)."""
    clock: Callable[[], float]
    """The host clock the budget is read from, in seconds."""
    started: float
    """When the budget started, on :attr:`clock`."""
    measured: Mapping[Phase, PhasePeak] | None
    """The sampled step's allocator peaks per phase, or ``None``."""
    carried: Calibration | None
    """The calibration every later replay carries (set here, after the baseline)."""
    allocator: AllocatorSettings | None
    """The allocator settings the replays' reserved peaks are simulated with and their allocation sequences kept for
    (``None``: none simulated, none kept)."""

    @property
    def accumulate(self) -> int:
        """``accumulate_grad_batches``: above 1, each replay runs a window's first micro-batch and a later one."""
        ...

    @property
    def device_type(self) -> str:
        """The counted device's type."""
        ...

    def seconds_left(self) -> float | None:
        """Host seconds left of the budget; ``None`` without one."""
        ...

    def out_of_time(self) -> bool:
        """Whether the budget has run out."""
        ...

    def replay(self, change: StepChange | None = None, count_flops: bool = False) -> ReplayedStep | ReplaySkipped:
        """One replay of the step with ``change`` (``None``: as it is), its FLOPs counted with ``count_flops``."""
        ...

    def reserved_with(self, settings: AllocatorSettings, steps_before: int | None = None) -> dict[Phase, int] | None:
        """The baseline's allocation sequence through the allocator model with ``settings``, per phase.

        ``steps_before``: as the run's step of that index holds it (a steady step's otherwise).
        """
        ...


def at_step(step: ReplayedStep, replays: Replays, index: int) -> ReplayedStep:
    """``step`` with each phase's reserved peak as the run's step ``index`` holds it, to set against that step.

    A replay's reserved peaks are a steady step's (:data:`~lightning_vram.prediction.replay.reserved.HISTORY_STEPS`
    steps before it); a step sampled earlier finds less reserved. Unchanged without a simulated allocator.
    """
    allocator = replays.allocator
    reserved = replays.reserved_with(allocator, index) if allocator is not None else None
    if not reserved:
        return step
    phases = {
        phase: replace(peak, reserved_bytes=reserved.get(phase, peak.reserved_bytes))
        for phase, peak in step.phases.items()
    }
    return replace(step, phases=phases)


def simulate(replays: Replays, changes: Sequence[StepChange] = (), tolerance: float = BASELINE_TOLERANCE) -> Simulation:
    """Replay the step, compare it with the calibration (the sampled step's counts), then replay each change.

    Safe to call inside the user's training: it leaves the module, optimizers, gradients, random number generators
    and what the user's code reaches as they were; it raises only what a replay raises (something it could not put
    back). Without a calibration (nothing counted yet, as before the first step) the baseline is trusted as
    replayed and ``match`` is ``None``. A replay running when the budget ends stops at its next op; changes not
    reached in time are discarded saying so. Each replay counts its FLOPs (``ReplayedStep.flops``), from which
    advice reads its time cost.

    Where the sampled step's allocator peaks are known (``replays.measured``), the baseline is set against them
    (:func:`~lightning_vram.prediction.replay.calibration.calibrate`), and what the allocator held beyond the replay
    is carried into the baseline and every later replay (``replays.carried``). Where the reserved memory is
    simulated with settings that lack expandable segments, the baseline's sequence is also run with them.

    Args:
        replays: the step's replays.
        changes: the changes to try, each replayed on its own.
        tolerance: how far each part may be from the count (a share of it) for the baseline to match.
    """
    attribution = replays.calibration
    budget = replays.budget_seconds

    def replay(change: StepChange | None) -> ReplayedStep | str:
        result = replays.replay(change, count_flops=True)
        if isinstance(result, ReplayedStep):
            return result
        if change is not None and replays.out_of_time():
            return f"{NOT_REPLAYED}: {BUDGET_RAN_OUT} of {budget} s during its replay"
        return result.reason

    allocator = replays.allocator
    expandable = None
    calibration: Calibration | None = None

    def finished(baseline: ReplayedStep | None, match: Any, skipped: str | None, variants: Any = ()) -> Simulation:
        return Simulation(
            replays.device_type,
            baseline,
            match,
            skipped,
            tuple(variants),
            replays.clock() - replays.started,
            calibration=calibration,
            allocator_conf=allocator.conf() if allocator is not None and baseline is not None else None,
            expandable_reserved_bytes=expandable,
            accumulate_grad_batches=replays.accumulate,
        )

    raw = replay(None)
    if isinstance(raw, str):
        return finished(None, None, raw)
    baseline = raw
    if allocator is not None and not allocator.expandable_segments:
        expandable = replays.reserved_with(replace(allocator, expandable_segments=True))
    match = match_baseline(raw, attribution, tolerance, replays.released_late()) if attribution is not None else None
    if replays.measured:
        sampled = attribution.step if attribution is not None else 0
        calibration = calibrate(at_step(raw, replays, sampled), replays.measured, sampled)
        replays.carried = calibration
        baseline = carry(raw, calibration) if calibration is not None else raw
    if match is not None and not match.matches:
        return finished(baseline, match, mismatch_reason(match))
    variants = []
    for change in changes:
        if replays.out_of_time():
            variants.append(VariantResult(change, None, f"{NOT_REPLAYED}: {BUDGET_RAN_OUT} of {budget} s first"))
            continue
        result = replay(change)
        variants.append(
            VariantResult(change, None, result) if isinstance(result, str) else VariantResult(change, result)
        )
    return finished(baseline, match, None, variants)
