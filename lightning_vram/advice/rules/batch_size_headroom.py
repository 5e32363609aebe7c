"""Batch-size headroom: the peak is under half the device, the GPU is not busy, and the data keeps up.

The largest batch is the replayed one (``Simulation.device_max_batch_size``, found by the fit table's search) where
the simulation searched it: on CUDA the largest whose step the simulated caching allocator serves in the device's
memory less the CUDA context (:mod:`~lightning_vram.prediction.replay.fit_table`), no margin kept. Else it is
modelled linearly from the measured peak (:func:`~lightning_vram.advice.capacity.predict_max_batch_size`), 10% of
the device kept free.
"""

from __future__ import annotations

from lightning_vram.advice.capacity import predict_max_batch_size
from lightning_vram.advice.rules.base import DATA_WAIT_WORKERS_SHARE, Rule, attributed_peak, no_changes, share_text
from lightning_vram.advice.savings import trusted
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN
from lightning_vram.records import Advice, AdviceId, RunSummary, Severity, Simulation, TrainingSetup
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.BATCH_SIZE_HEADROOM
HEADROOM_MAX_PEAK_SHARE = 0.5
"""A peak under half the capacity leaves room for at least twice the batch."""
HEADROOM_MAX_UTILIZATION_PERCENT = 70.0
"""Above this utilization a larger batch mostly makes each step longer, not the run shorter."""


def batch_size_headroom(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """The peak is under half the device, the GPU is not busy, and the data keeps up: a larger batch fits."""
    attributed = attributed_peak(summary)
    capacity = summary.device.total_bytes
    utilization = summary.gpu_utilization_mean
    if not summary.on_cuda or attributed is None or capacity is None or summary.batch_size is None:
        return None
    peak, _ = attributed
    if peak.peak_bytes >= HEADROOM_MAX_PEAK_SHARE * capacity:
        return None
    if utilization is None or utilization >= HEADROOM_MAX_UTILIZATION_PERCENT:
        return None
    if summary.data_wait_fraction is None or summary.data_wait_fraction >= DATA_WAIT_WORKERS_SHARE:
        return None
    replayed = simulation.device_max_batch_size if simulation is not None and trusted(simulation) else None
    largest = replayed if replayed is not None else predict_max_batch_size(summary, capacity)
    if largest is None or largest < 2 * summary.batch_size:
        return None
    how = (
        "largest batch modelled linearly from the measured peak (not replayed), keeping"
        f" {format_percent(BATCH_SAFETY_MARGIN)} of the device free"
    )
    if replayed is not None:
        how = "largest batch found by replaying this step at each batch size tried, keeping"
        how += f" {format_percent(BATCH_SAFETY_MARGIN)} of the device free"
        allocator = _served_by(simulation)
        if allocator is not None:
            how = (
                "largest batch whose replayed step the simulated caching allocator"
                f" ({allocator or 'torch defaults'}) serves in the device's memory less the CUDA context"
            )
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=(
            f"A batch of up to {largest} {'fits, replayed' if replayed is not None else 'should fit'}"
            f" (now {summary.batch_size}): the GPU is underused"
        ),
        detail=(
            "A larger batch gives each kernel more work. Raise it and scale the learning rate, or keep the batch"
            " and train a larger model. Once the GPU is busy, a larger batch makes steps longer, not training"
            " faster. Unlike a memory-only change, it trains another model: fewer, larger steps (hence the learning"
            " rate) and BatchNorm statistics over more samples, so validate it.\n"
            f"```python\nDataLoader(dataset, ..., batch_size={largest})  # `...`: your other arguments, unchanged\n```"
        ),
        evidence=(
            f"peak {format_bytes(peak.peak_bytes)} of {format_bytes(capacity)}"
            f" ({share_text(peak.peak_bytes, capacity)}); GPU utilization {utilization:.0f}%; data wait"
            f" {format_percent(summary.data_wait_fraction)}; {how}"
        ),
        estimated_saving_bytes=None,
    )


def _served_by(simulation: Simulation | None) -> str | None:
    """The allocator settings the simulation's fit search served its batches with (``None``: not simulated)."""
    rows = simulation.fit if simulation is not None else ()
    return next((row.allocator for row in rows if row.allocator is not None), None)


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why a larger batch is not advised: the peak's share of the device, the GPU's load, the data wait, or the fit.

    ``None`` off CUDA or where the peak, the device's memory or the batch size was not measured.
    """
    attributed = attributed_peak(summary)
    capacity = summary.device.total_bytes
    if not summary.on_cuda or attributed is None or capacity is None or summary.batch_size is None:
        return None
    peak = attributed[0].peak_bytes
    utilization, wait = summary.gpu_utilization_mean, summary.data_wait_fraction
    if peak >= HEADROOM_MAX_PEAK_SHARE * capacity:
        return (
            f"the peak ({format_bytes(peak)}) is {share_text(peak, capacity)} of the device's {format_bytes(capacity)},"
            f" over the {format_percent(HEADROOM_MAX_PEAK_SHARE)} the rule allows"
        )
    if utilization is None:
        limit = f"{HEADROOM_MAX_UTILIZATION_PERCENT:.0f}%"
        return f"GPU utilization was not measured (no NVML): the rule needs it under {limit}"
    if utilization >= HEADROOM_MAX_UTILIZATION_PERCENT:
        return (
            f"the GPU is busy {utilization:.0f}% of the time, over the {HEADROOM_MAX_UTILIZATION_PERCENT:.0f}% the"
            " rule allows: a larger batch mostly makes each step longer"
        )
    if wait is None or wait >= DATA_WAIT_WORKERS_SHARE:
        measured = "not measured" if wait is None else f"{format_percent(wait)} of step time"
        return f"data wait is {measured}: the rule needs it under {format_percent(DATA_WAIT_WORKERS_SHARE)}"
    replayed = simulation.device_max_batch_size if simulation is not None and trusted(simulation) else None
    largest = replayed if replayed is not None else predict_max_batch_size(summary, capacity)
    how = "replayed" if replayed is not None else "modelled"
    return f"the largest batch that fits ({how}) is {largest}, under twice the run's {summary.batch_size}"


RULE = Rule(ID, batch_size_headroom, no_changes, why_not)
