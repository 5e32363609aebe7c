"""A run's sampled step replayed, checked against its counts, and each candidate change tried on it.

The entry point the monitor calls once a sampled step has been counted: :func:`simulate`. Nothing is trusted
before the baseline matches; each change is then replayed within the time budget, and one that raises (a
checkpointing plan that breaks backward, an optimizer that cannot run in that precision) is discarded with the
reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_vram.prediction.replay.baseline import BASELINE_TOLERANCE, match_baseline, mismatch_reason
from lightning_vram.prediction.replay.step import StepFunction, lightning_training_step, replay_step
from lightning_vram.prediction.replay.twin import module_device
from lightning_vram.records import Attribution, ReplayedStep, Simulation, StepChange, VariantResult
from lightning_vram.records.simulation import NOT_REPLAYED

BUDGET_RAN_OUT = "the replay budget ran out"
"""Why a change, or a fit table's row, is missing when the time budget ended first."""


def simulate(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    attribution: Attribution | None,
    changes: Sequence[StepChange] = (),
    *,
    precision: str = "32-true",
    device: torch.device | None = None,
    step_function: StepFunction = lightning_training_step,
    time_budget_seconds: float | None = None,
    tolerance: float = BASELINE_TOLERANCE,
    gradients_at_forward: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Simulation:
    """Replay the step, compare it with ``attribution`` (the sampled step's counts), then replay each change.

    Safe to call inside the user's training: it leaves the module, optimizers, gradients, random number generators
    and what the user's code reaches as they were; it raises only what
    :func:`~lightning_vram.prediction.replay.step.replay_step` raises (something it could not put back). Without
    ``attribution`` (nothing counted yet, as before the first step) the baseline is trusted as replayed and
    ``match`` is ``None``.

    Args:
        module: the module trained (left untouched).
        optimizers: its optimizers (rebuilt on the replay's fake parameters, their state faked).
        batch: the sampled step's batch.
        attribution: the sampled step's counts, or ``None``.
        changes: the changes to try, each replayed on its own.
        time_budget_seconds: host seconds for all of it, the baseline included: a replay running when it ends stops
            at its next op; changes not reached in time are discarded saying so.
        precision: the run's precision, as Lightning names it.
        device: the device whose memory is counted; default: the module's.
        step_function: runs the training step (default: ``training_step``), as for
            :func:`~lightning_vram.prediction.replay.step.replay_step`.
        tolerance: how far each part may be from the count (a share of it) for the baseline to match.
        gradients_at_forward: whether the run's forward pass starts with the previous step's gradients alive (see
            :func:`~lightning_vram.prediction.replay.step.replay_step`).
        clock: the host clock the budget is read from, in seconds (tests script it).
    """
    started = clock()
    deadline = None if time_budget_seconds is None else started + time_budget_seconds
    step = attribution.step if attribution is not None else 0
    device_type = (device or module_device(module)).type

    def replay(change: StepChange | None) -> ReplayedStep | str:
        left = None if deadline is None else deadline - clock()
        result = replay_step(
            module,
            optimizers,
            batch,
            precision=precision,
            change=change,
            device=device,
            step_function=step_function,
            step=step,
            gradients_at_forward=gradients_at_forward,
            deadline=None if left is None else time.perf_counter() + left,
        )
        if isinstance(result, ReplayedStep):
            return result
        if change is not None and deadline is not None and clock() >= deadline:
            return f"{NOT_REPLAYED}: {BUDGET_RAN_OUT} of {time_budget_seconds} s during its replay"
        return result.reason

    def finished(baseline: ReplayedStep | None, match: Any, skipped: str | None, variants: Any = ()) -> Simulation:
        return Simulation(device_type, baseline, match, skipped, tuple(variants), clock() - started)

    baseline = replay(None)
    if isinstance(baseline, str):
        return finished(None, None, baseline)
    match = match_baseline(baseline, attribution, tolerance) if attribution is not None else None
    if match is not None and not match.matches:
        return finished(baseline, match, mismatch_reason(match))
    variants = []
    for change in changes:
        if deadline is not None and clock() >= deadline:
            variants.append(
                VariantResult(change, None, f"{NOT_REPLAYED}: {BUDGET_RAN_OUT} of {time_budget_seconds} s first")
            )
            continue
        result = replay(change)
        variants.append(
            VariantResult(change, None, result) if isinstance(result, str) else VariantResult(change, result)
        )
    return finished(baseline, match, None, variants)
