"""Pinned memory: CUDA training with pin_memory off while the step measurably waits for data."""

from __future__ import annotations

from lightning_vram.advice.rules.base import Rule, data_wait_reason, no_changes, sustained_data_wait
from lightning_vram.records import Advice, AdviceId, RunSummary, Severity, Simulation, TrainingSetup
from lightning_vram.units import format_percent

ID = AdviceId.PIN_MEMORY
DATA_WAIT_PIN_SHARE = 0.05
"""Pinned memory is a one-word change; advise it from 5% of step time (the bar of TensorBoard's old profiler plugin)."""


def pin_memory(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """CUDA training with pin_memory off while the step measurably waits for data."""
    if not summary.on_cuda or setup.pin_memory is not False or not sustained_data_wait(summary, DATA_WAIT_PIN_SHARE):
        return None
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title="Pin host memory: DataLoader(pin_memory=True)",
        detail=(
            "Pageable host memory is copied once more before the transfer to the GPU; pinned batches are copied"
            " straight away, and Lightning moves them with non_blocking transfers. The batches' values are the"
            " same: training is unchanged, bit for bit.\n"
            "```python\nDataLoader(dataset, ..., pin_memory=True)  # `...`: your own arguments, unchanged\n```"
        ),
        evidence=(
            f"data wait is {format_percent(summary.data_wait_fraction)} of step time on {summary.device.name};"
            " pin_memory=False. The transfer's own share of the wait is not measured separately."
        ),
        estimated_saving_bytes=None,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why pinned memory is not advised: on already, off CUDA, or the measured data-wait share under the threshold.

    ``None`` where the run's DataLoader is not known (no ``pin_memory`` read).
    """
    if setup.pin_memory is None:
        return None
    if setup.pin_memory:
        return "the DataLoader pins host memory already (pin_memory=True)"
    if not summary.on_cuda:
        return "pin_memory=True: pinned host memory speeds copies to a CUDA GPU only"
    reason = data_wait_reason(summary, DATA_WAIT_PIN_SHARE)
    return f"pin_memory=True: {reason}" if reason is not None else None


RULE = Rule(ID, pin_memory, no_changes, why_not)
