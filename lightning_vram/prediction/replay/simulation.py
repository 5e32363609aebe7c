"""A run's sampled step replayed, checked against its counts, and each candidate change tried on it.

The entry point the monitor calls once a sampled step has been counted: :func:`simulate`. Nothing is trusted
before the baseline matches; each change is then replayed within the time budget, and one that raises (a
checkpointing plan that breaks backward, an optimizer that cannot run in that precision) is discarded with the
reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.baseline import BASELINE_TOLERANCE, match_baseline, mismatch_reason
from lightning_vram.records import (
    Attribution,
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
    clock: Callable[[], float]
    """The host clock the budget is read from, in seconds."""
    started: float
    """When the budget started, on :attr:`clock`."""
    allocator: AllocatorSettings | None
    """The caching allocator's settings each replay's allocation sequence is kept for (``None``: none kept)."""

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

    def replay(self, change: StepChange | None = None) -> ReplayedStep | ReplaySkipped:
        """One replay of the step with ``change`` (``None``: as it is)."""
        ...


def simulate(replays: Replays, changes: Sequence[StepChange] = (), tolerance: float = BASELINE_TOLERANCE) -> Simulation:
    """Replay the step, compare it with the calibration (the sampled step's counts), then replay each change.

    Safe to call inside the user's training: it leaves the module, optimizers, gradients, random number generators
    and what the user's code reaches as they were; it raises only what a replay raises (something it could not put
    back). Without a calibration (nothing counted yet, as before the first step) the baseline is trusted as
    replayed and ``match`` is ``None``. A replay running when the budget ends stops at its next op; changes not
    reached in time are discarded saying so.

    Args:
        replays: the step's replays.
        changes: the changes to try, each replayed on its own.
        tolerance: how far each part may be from the count (a share of it) for the baseline to match.
    """
    attribution = replays.calibration
    budget = replays.budget_seconds

    def replay(change: StepChange | None) -> ReplayedStep | str:
        result = replays.replay(change)
        if isinstance(result, ReplayedStep):
            return result
        if change is not None and replays.out_of_time():
            return f"{NOT_REPLAYED}: {BUDGET_RAN_OUT} of {budget} s during its replay"
        return result.reason

    def finished(baseline: ReplayedStep | None, match: Any, skipped: str | None, variants: Any = ()) -> Simulation:
        return Simulation(
            replays.device_type, baseline, match, skipped, tuple(variants), replays.clock() - replays.started
        )

    baseline = replay(None)
    if isinstance(baseline, str):
        return finished(None, None, baseline)
    match = match_baseline(baseline, attribution, tolerance) if attribution is not None else None
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
