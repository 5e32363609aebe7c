"""The fit table by replay: for each common GPU, the largest batch whose replayed step fits beside the CUDA context."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_vram.advice.catalogue import BATCH_SAFETY_MARGIN, COMMON_GPUS
from lightning_vram.advice.replay.search import MAX_BATCH_SIZE, largest_batch_that_fits
from lightning_vram.advice.replay.step import StepFunction, lightning_training_step, replay_step
from lightning_vram.measure.tensors import batch_size_of
from lightning_vram.records import BatchSizeChange, FitRow, ReplayedStep, SavingBasis


def replayed_fit_table(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | None,
    batch: Any,
    *,
    context_bytes: int,
    precision: str = "32-true",
    device: torch.device | None = None,
    placement: torch.device | None = None,
    step_function: StepFunction = lightning_training_step,
    warm_up: bool = False,
    gpus: Sequence[tuple[str, int]] = COMMON_GPUS,
    deadline: float | None = None,
) -> tuple[FitRow, ...]:
    """The largest batch per GPU whose replayed peak plus ``context_bytes`` leaves the safety margin free.

    Each batch size the search tries is replayed once (a few per GPU). Empty when the batch has no batch dimension,
    a replay fails, or ``time.perf_counter()`` passes ``deadline`` (seconds) before the search ends. The other
    arguments are :func:`~lightning_vram.advice.replay.step.replay_step`'s.
    """
    start = batch_size_of(batch)
    if start is None:
        return ()
    peaks: dict[int, int | None] = {}

    def peak_bytes(size: int) -> int | None:
        if deadline is not None and time.perf_counter() > deadline:
            return None
        if size not in peaks:
            result = replay_step(
                module,
                optimizers,
                batch,
                precision=precision,
                change=BatchSizeChange(size),
                device=device,
                placement=placement,
                step_function=step_function,
                warm_up=warm_up,
                deadline=deadline,
            )
            peaks[size] = result.peak.peak_bytes if isinstance(result, ReplayedStep) else None
        return peaks[size]

    rows = []
    for name, capacity in gpus:
        budget = int(capacity * (1 - BATCH_SAFETY_MARGIN)) - context_bytes
        largest = largest_batch_that_fits(peak_bytes, budget, start)
        if largest is None:
            return ()
        rows.append(FitRow(name, capacity, largest, basis=SavingBasis.SIMULATED, at_least=largest >= MAX_BATCH_SIZE))
    return tuple(rows)
