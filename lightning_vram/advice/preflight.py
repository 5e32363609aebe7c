"""Out-of-memory foreseen: before the first step on a CUDA device, replay it and warn when it cannot fit.

The first step is replayed under fake tensors with one uncounted warm-up step (so gradients and optimizer state
exist as they will from step 1 on). Memory already allocated (the model, the batch) is in the replay too, so what
the step still needs is the replayed peak minus what is allocated now; what it can have is the driver's free
memory plus the allocator's cached, unused blocks. When it does not fit, each candidate change is replayed the
same way and the warning lists them, largest saving first, marking those that make the step fit. Given the largest
shape the run expects (``max_shape``, or the shape ``max_length`` means), the first batch is replayed resized to it:
the check is for the largest batch, before it arrives.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_vram.advice.catalogue import FULL_PRECISIONS, mixed_precision_for
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.replay.step import StepFunction, replay_step
from lightning_vram.records import (
    AllocatorReading,
    BatchSizeChange,
    FreeGradientsChange,
    PrecisionChange,
    PreflightRemedy,
    PreflightVerdict,
    ReplayedStep,
    ReplaySkipped,
    StepChange,
)


def candidate_changes(
    precision: str, batch_size: int | None, compute_capability: tuple[int, int] | None
) -> list[StepChange]:
    """The changes preflight tries on a CUDA device: 16-bit mixed precision, freed gradients, half the batch."""
    changes: list[StepChange] = []
    if precision in FULL_PRECISIONS:
        changes.append(PrecisionChange(mixed_precision_for("cuda", compute_capability)))
    changes.append(FreeGradientsChange())
    if batch_size is not None and batch_size >= 2:
        changes.append(BatchSizeChange(batch_size // 2))
    return changes


def preflight(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    *,
    reading: AllocatorReading,
    free_bytes: int,
    changes: Sequence[StepChange],
    precision: str,
    step_function: StepFunction,
    budget_seconds: float,
    shape: tuple[int, ...] | None = None,
) -> PreflightVerdict | str:
    """Replay the first step; the verdict, or why it could not be replayed.

    Raises only when a replay left something behind it could not take back
    (:class:`~lightning_vram.prediction.containment.containment.ContainmentError`,
    :class:`~lightning_vram.prediction.containment.escapes.ReplayEscapeError`): the caller turns replays off.

    Args:
        module: the module about to train (left untouched).
        optimizers: its optimizers (their state is created in the replay's warm-up step).
        batch: the first batch, on the device.
        reading: the allocator now (what is allocated and cached).
        free_bytes: the device's free memory now.
        changes: the changes to replay when the step does not fit.
        precision: the run's precision, as Lightning names it.
        step_function: runs the training step on the replay's module.
        budget_seconds: host seconds for all the replays; one running when they end stops at its next op, and
            changes not reached in time are left out.
        shape: replay the batch resized to this shape past its batch dimension (``max_shape``, or the shape
            ``max_length`` means); ``None``: as it is.
    """
    deadline = time.perf_counter() + budget_seconds

    def replay(change: StepChange | None) -> ReplayedStep | ReplaySkipped:
        return replay_step(
            module,
            optimizers,
            batch,
            precision=precision,
            step_function=step_function,
            warm_up=True,
            change=change,
            deadline=deadline,
            shape=shape,
        )

    with round_of_replays():
        replayed = replay(None)
        if not isinstance(replayed, ReplayedStep):
            return replayed.reason
        verdict = PreflightVerdict(
            step=replayed,
            needed_bytes=max(replayed.peak.peak_bytes - reading.allocated_bytes, 0),
            available_bytes=free_bytes + max(reading.reserved_bytes - reading.allocated_bytes, 0),
            remedies=(),
        )
        if verdict.fits:
            return verdict
        remedies: list[PreflightRemedy] = []
        for change in changes:
            if time.perf_counter() > deadline:
                break
            result = replay(change)
            if isinstance(result, ReplayedStep) and result.peak.peak_bytes < replayed.peak.peak_bytes:
                remedies.append(PreflightRemedy(change.label, result.peak.peak_bytes))
        remedies.sort(key=lambda remedy: remedy.peak_bytes)
        return PreflightVerdict(verdict.step, verdict.needed_bytes, verdict.available_bytes, tuple(remedies))


def replay_resized(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    *,
    shape: tuple[int, ...] | None,
    precision: str,
    step_function: StepFunction,
    budget_seconds: float,
) -> ReplayedStep | str:
    """Replay the first step with its batch resized to ``shape`` (after a warm-up step); or why it could not be.

    ``shape``: the sizes past the batch dimension (elements; ``None``: as it is). Where no free memory is known (the
    CPU): the prediction for the report's table of peaks per length. Raises what :func:`preflight` raises.
    """
    with round_of_replays():
        replayed = replay_step(
            module,
            optimizers,
            batch,
            precision=precision,
            step_function=step_function,
            warm_up=True,
            deadline=time.perf_counter() + budget_seconds,
            shape=shape,
        )
    return replayed if isinstance(replayed, ReplayedStep) else replayed.reason
