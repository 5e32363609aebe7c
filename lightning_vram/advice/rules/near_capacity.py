"""Near capacity: the peak is above 90% of the device, or the allocator retried or ran out; remedies, largest first.

Each remedy is another rule's advice (:data:`NEAR_CAPACITY_REMEDIES`), with the saving and basis that rule
resolved, or a halved batch, declared for replay here: its saving is the replayed one where the simulation tried
that batch, else half of what grows with the batch. Where the halved batch's replay simulated the caching
allocator, the remedy says whether the simulated allocator serves its step in the device's memory less the CUDA
context (:func:`~lightning_vram.prediction.replay.serves.serves_step`): what "fits" means on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_vram.advice.rules import (
    activation_checkpointing,
    allocator_fragmentation,
    chunked_loss,
    inplace_activations,
    mixed_precision,
    offload_optimizer,
    optimizer_state,
    stale_gradients,
)
from lightning_vram.advice.rules.base import NEAR_CAPACITY_SHARE, Rule, attributed_peak, replayed_reason, share_text
from lightning_vram.advice.savings import Modelled, Saving, resolve_saving
from lightning_vram.prediction.devices import DEFAULT_CUDA_CONTEXT_BYTES
from lightning_vram.prediction.replay.serves import serves_step
from lightning_vram.records import (
    Advice,
    AdviceId,
    BatchSizeChange,
    Breakdown,
    PhasePeak,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    StepChange,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.units import format_bytes

ID = AdviceId.NEAR_CAPACITY
NONE_MEASURED = "none measured"
"""How the detail ends when the run's measurements support no remedy (the OOM diagnosis puts preflight's there)."""
NEAR_CAPACITY_REMEDIES: tuple[Rule, ...] = (
    activation_checkpointing.RULE,
    mixed_precision.RULE,
    inplace_activations.RULE,
    stale_gradients.RULE,
    chunked_loss.RULE,
    optimizer_state.RULE,
    offload_optimizer.RULE,
    allocator_fragmentation.RULE,
)
"""The rules whose savings near-capacity lists as remedies."""


class Remedy(NamedTuple):
    """One way out of near-capacity: what to do, what it saves in bytes, and how that saving is known."""

    name: str
    saving_bytes: int
    basis: SavingBasis
    predicted_peak_bytes: int | None


def _near_capacity_peak(summary: RunSummary) -> tuple[PhasePeak, Breakdown] | None:
    """The run's attributed peak when the run is near capacity on a CUDA device, else ``None``."""
    attributed = attributed_peak(summary)
    capacity = summary.device.total_bytes
    if not summary.on_cuda or attributed is None or capacity is None:
        return None
    near = attributed[0].peak_bytes >= NEAR_CAPACITY_SHARE * capacity
    return attributed if near or (summary.alloc_retries or 0) > 0 or (summary.recovered_ooms or 0) > 0 else None


def _halved(summary: RunSummary) -> BatchSizeChange | None:
    """Half the run's batch, when it has one of 2 or more."""
    if summary.batch_size is None or summary.batch_size < 2:
        return None
    return BatchSizeChange(summary.batch_size // 2)


def changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """Half the batch, when the run so far is near capacity."""
    halved = _halved(summary)
    return (halved,) if halved is not None and _near_capacity_peak(summary) is not None else ()


def _accumulating(setup: TrainingSetup) -> str:
    """How the halved batch keeps the run's global batch: Lightning's setting, or the user's own code.

    Lightning's setting where Lightning accumulates (automatic optimization), else the user's own code.

    Under manual optimization Lightning refuses ``Trainer(accumulate_grad_batches=...)`` (a MisconfigurationException
    at fit), and a plain or Fabric loop has no such setting: the accumulation is the user's step's.
    """
    accumulate = 2 * setup.accumulate_grad_batches
    if setup.lightning_accumulates:
        return f"with accumulate_grad_batches={accumulate}"
    where = (
        "in training_step: Lightning refuses accumulate_grad_batches under manual optimization"
        if setup.loop is TrainingLoop.LIGHTNING
        else "in your loop"
    )
    return (
        f"accumulating the gradients of {accumulate} such batches per optimizer step, each loss divided by"
        f" {accumulate}, {where}"
    )


def _halved_batch(
    summary: RunSummary, peak: PhasePeak, breakdown: Breakdown, simulation: Simulation | None, setup: TrainingSetup
) -> Remedy | None:
    """Halving the batch: replayed where the simulation tried that batch, else half of what grows with the batch.

    The run's accumulation doubles to keep its global batch (:func:`_accumulating`).
    """
    halved = _halved(summary)
    if halved is None:
        return None
    modelled = (
        Modelled((breakdown.activations + breakdown.other) // 2, peak.peak_bytes, "half of what grows with the batch")
        if breakdown.other is not None
        else None
    )
    saving = resolve_saving(simulation, halved, modelled, measured=peak)
    if not isinstance(saving, Saving):
        return None
    name = f"halve the batch to {halved.batch_size} ({_accumulating(setup)})"
    name += _served_text(summary, halved, simulation)
    return Remedy(name, saving.saving_bytes, saving.basis, saving.predicted_peak_bytes)


def _served_text(summary: RunSummary, change: BatchSizeChange, simulation: Simulation | None) -> str:
    """Whether the simulated allocator serves the step with ``change`` on this device, as a remedy's suffix."""
    capacity = summary.device.total_bytes
    variant = next(
        (variant for variant in (simulation.variants if simulation is not None else ()) if variant.change == change),
        None,
    )
    if capacity is None or variant is None or variant.replayed is None:
        return ""
    context = summary.cuda_context_bytes if summary.cuda_context_bytes is not None else DEFAULT_CUDA_CONTEXT_BYTES
    serving = serves_step(variant.replayed, capacity - context)
    if serving is None:
        return ""
    if serving.served:
        return f", served by the simulated allocator (reserved {format_bytes(serving.reserved_peak_bytes)})"
    return ", still not served by the simulated allocator"


def _halved_trains(summary: RunSummary, setup: TrainingSetup) -> str:
    """What training with half the batch and twice the run's ``accumulate`` changes: a sentence for the detail.

    The gradients of two halves, each loss divided by 2, add up to the whole batch's in another order where the loss
    is a mean over the samples: not a mean over the tokens a padded batch's ``ignore_index`` keeps (tests' padded
    batch: gradients 10% apart), nor a sum (halved: 50% apart), nor in-batch negatives. BatchNorm normalises over
    each half and updates its statistics once per half.
    """
    text = (
        f" Half the batch {_accumulating(setup)} sums the gradients of two halves: the same as"
        " the whole batch's up to float32 rounding (about 1e-6 relative) where the loss is a mean over the batch's"
        " samples (a mean over the tokens ignore_index keeps, whose count differs between the halves, a summed loss,"
        " which the accumulation halves, or a loss comparing the batch's samples, in-batch negatives, trains another"
        " model)"
    )
    if not any("BatchNorm" in profile.type for profile in summary.modules):
        return f"{text}."
    assert summary.batch_size is not None  # a halved batch was offered
    return (
        f"{text}, but this model's BatchNorm then normalises over {summary.batch_size // 2} samples instead of"
        f" {summary.batch_size} and updates its running statistics twice a step (num_batches_tracked too): it"
        " trains a different model: validate it."
    )


def near_capacity(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """The peak is above 90% of the device, or the allocator retried or ran out: list the remedies, largest first."""
    attributed = _near_capacity_peak(summary)
    capacity = summary.device.total_bytes
    if attributed is None or capacity is None:
        return None
    peak, breakdown = attributed
    remedies = [
        Remedy(
            advice.id,
            advice.estimated_saving_bytes,
            advice.saving_basis or SavingBasis.MODELLED,
            advice.predicted_peak_bytes,
        )
        for rule in NEAR_CAPACITY_REMEDIES
        if (advice := rule.advise(summary, setup, simulation)) is not None and advice.estimated_saving_bytes
    ]
    halved = _halved_batch(summary, peak, breakdown, simulation, setup)
    if halved is not None and halved.saving_bytes > 0:
        remedies.append(halved)
    remedies.sort(key=lambda remedy: -remedy.saving_bytes)
    listed = "; ".join(
        f"{remedy.name}: about {format_bytes(remedy.saving_bytes)} ({remedy.basis})" for remedy in remedies
    )
    best = remedies[0] if remedies else None
    retries, ooms = summary.alloc_retries or 0, summary.recovered_ooms or 0
    return Advice(
        id=ID,
        severity=Severity.CRITICAL,
        title=f"Memory is near capacity ({share_text(peak.peak_bytes, capacity)} of the device): one step from OOM",
        detail=f"Remedies this run's measurements support, largest saving first: {listed or NONE_MEASURED}."
        + (_halved_trains(summary, setup) if halved is not None and halved in remedies else ""),
        evidence=(
            f"peak {format_bytes(peak.peak_bytes)} of {format_bytes(capacity)} in {peak.phase.value} of step"
            f" {peak.step}; {retries} allocation retries; {ooms} out-of-memory errors recovered from"
        ),
        estimated_saving_bytes=best.saving_bytes if best is not None else None,
        saving_basis=best.basis if best is not None else None,
        predicted_peak_bytes=best.predicted_peak_bytes if best is not None else None,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why the rule is silent: the halved batch's replayed figure, else the peak's share of the device (CUDA only)."""
    answered = replayed_reason(simulation, changes(summary, setup), "the run is not near capacity")
    attributed, capacity = attributed_peak(summary), summary.device.total_bytes
    near = _near_capacity_peak(summary) is not None
    if answered is not None or near or not summary.on_cuda or attributed is None or capacity is None:
        return answered
    peak = attributed[0].peak_bytes
    return (
        f"the peak ({format_bytes(peak)}) is {share_text(peak, capacity)} of the device's {format_bytes(capacity)},"
        f" under the {NEAR_CAPACITY_SHARE:.0%} the rule needs, with no allocation retries or recovered out-of-memory"
    )


RULE = Rule(ID, near_capacity, changes, why_not)
