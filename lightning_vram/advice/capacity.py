"""The largest batch that fits a device: modelled from the measured peak, or read from the replay's search.

Fixed cost: parameters, gradients, optimizer state and the CUDA context. Per-sample cost: activations and ``other``
at the peak divided by the batch size. A :data:`~lightning_vram.prediction.devices.BATCH_SAFETY_MARGIN` of capacity
stays free.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_vram.advice.rules.base import attributed_peak
from lightning_vram.advice.savings import trusted
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, COMMON_GPUS, DEFAULT_CUDA_CONTEXT_BYTES
from lightning_vram.records import FitRow, RunSummary, SavingBasis, Simulation


def predict_max_batch_size(summary: RunSummary, capacity_bytes: int) -> int | None:
    """The largest batch of this run predicted to fit in ``capacity_bytes``, modelled linearly from the peak.

    ``None`` when the peak's breakdown or the batch size was not measured (or nothing grows with the batch); 0
    when not even the fixed cost fits.
    """
    attributed = attributed_peak(summary)
    if attributed is None or summary.batch_size is None or summary.batch_size <= 0:
        return None
    _, breakdown = attributed
    if breakdown.other is None:
        return None
    per_sample = (breakdown.activations + breakdown.other) / summary.batch_size
    context = summary.cuda_context_bytes if summary.cuda_context_bytes is not None else DEFAULT_CUDA_CONTEXT_BYTES
    fixed = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state + context
    usable = capacity_bytes * (1 - BATCH_SAFETY_MARGIN) - fixed
    if per_sample <= 0 or usable <= 0:
        return 0 if usable <= 0 else None
    return int(usable // per_sample)


def fit_table(
    summary: RunSummary, simulation: Simulation | None = None, accumulate: int = 1, own_accumulation: bool = False
) -> tuple[FitRow, ...]:
    """The largest batch of this run per GPU of :data:`~lightning_vram.prediction.devices.COMMON_GPUS`.

    Replayed rows (``basis`` ``"simulated"``) come from a trusted simulation's ``fit``; otherwise each row is
    modelled linearly from the measured peak (``basis`` ``"modelled"``, CUDA runs only). Where the run's batch does
    not fit a row's GPU, the row gives the micro-batch and ``accumulate_grad_batches`` that keep the run's global
    batch (its batch times ``accumulate``, the run's ``accumulate_grad_batches``): :meth:`FitRow.keeping`;
    ``own_accumulation``: the run's own code accumulates (:attr:`FitRow.own_accumulation`).
    """
    if trusted(simulation) is not None and simulation is not None and simulation.fit:
        rows = [replace(row, basis=SavingBasis.SIMULATED) for row in simulation.fit]
    elif not summary.on_cuda:
        return ()
    else:
        rows = []
        for name, capacity in COMMON_GPUS:
            batch = predict_max_batch_size(summary, capacity)
            if batch is None:
                return ()
            rows.append(FitRow(name, capacity, batch, basis=SavingBasis.MODELLED))
    size = summary.batch_size
    return tuple(row.keeping(size, accumulate, own_accumulation) if size else row for row in rows)
