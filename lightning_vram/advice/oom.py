"""Out-of-memory diagnosis: where the run died, what it asked for, what held the memory, and what to change."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from lightning_vram.advice.rules.near_capacity import NONE_MEASURED
from lightning_vram.advice.rules.registry import advise
from lightning_vram.records import (
    Advice,
    AdviceId,
    AllocatorReading,
    Breakdown,
    OomDiagnosis,
    OomMessage,
    Phase,
    PhasePeak,
    PreflightVerdict,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    TrainingSetup,
)
from lightning_vram.units import format_bytes

_UNITS = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
_FIELDS = {
    "tried_bytes": rf"Tried to allocate {_SIZE}",
    "capacity_bytes": rf"total capacity of {_SIZE}",
    "free_bytes": rf"of which {_SIZE} is free",
    "process_bytes": rf"this process has {_SIZE} memory in use",
    "allocated_bytes": rf"{_SIZE} is allocated by PyTorch",
    "reserved_unallocated_bytes": rf"{_SIZE} is reserved by PyTorch but unallocated",
}


def parse_size(number: str, unit: str) -> int:
    """Bytes of a size as torch prints it.

    >>> parse_size("1.50", "GiB")
    1610612736
    """
    return round(float(number) * _UNITS[unit])


def parse_oom_message(text: str) -> OomMessage:
    """Read the figures out of a CUDA out-of-memory message.

    >>> parse_oom_message("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    ...                   "8.00 GiB of which 0 bytes is free.").tried_bytes
    20971520
    """
    values: dict[str, int] = {}
    for field, pattern in _FIELDS.items():
        match = re.search(pattern, text)
        if match is not None:
            values[field] = parse_size(match.group(1), match.group(2))
    return OomMessage(**values)


def evaluation_batch_size(step: int, training_peak: PhasePeak | None, batch_size: int | None = None) -> Advice:
    """Advice for an out-of-memory error in validation: evaluate with a smaller batch (id ``evaluation-batch-size``).

    ``batch_size``: the validation batch that ran out, where known: halved, as validation's own (a validation batch
    already smaller than training's would grow at half the training batch); a batch of one cannot be.
    """
    peak_text = (
        f"training peaked at {format_bytes(training_peak.peak_bytes)} ({training_peak.phase.value} of step"
        f" {training_peak.step})"
        if training_peak is not None
        else "no training step was measured before it"
    )
    return Advice(
        id=AdviceId.EVALUATION_BATCH_SIZE,
        severity=Severity.CRITICAL,
        title="Validate with a smaller batch",
        detail=(
            "Lightning already runs validation without autograd, so no activations are kept for backward; what"
            " filled the device is the validation batch and its forward pass on top of the model state (and the"
            " cache training left). " + _smaller_validation_batch(batch_size)
        ),
        evidence=f"out of memory in validation after step {step}; {peak_text}"
        + (f"; the validation batch held {batch_size} sample(s)" if batch_size is not None else ""),
        estimated_saving_bytes=None,
    )


def _smaller_validation_batch(batch_size: int | None) -> str:
    """The change to validation's batch: half the batch that ran out, in words and code.

    >>> print(_smaller_validation_batch(8).splitlines()[-2])
        return DataLoader(val_set, ..., batch_size=4)  # half the validation batch of 8 that ran out
    """
    if batch_size == 1:
        return (
            "The validation batch that ran out holds one sample: no smaller batch is left. Make what one sample"
            " holds smaller for validation (a shorter max_length, a smaller image), or validate less of it"
            " (`Trainer(limit_val_batches=...)`)."
        )
    halved = f"{batch_size // 2}" if batch_size is not None else "validation_batch_size // 2"
    told = f"  # half the validation batch of {batch_size} that ran out" if batch_size is not None else ""
    return (
        "Give validation its own batch, half the one that ran out (not half of training's, which may be larger):\n"
        "```python\ndef val_dataloader(self):\n"
        f"    return DataLoader(val_set, ..., batch_size={halved}){told}\n```"
    )


def preflight_remedies_text(verdict: PreflightVerdict) -> str:
    """Preflight's replayed remedies with their figures: each one's replayed peak, saving, and whether it fits.

    Whether it fits is judged as preflight judged it: served by the simulated allocator where it was simulated, else
    its peak less what was allocated before step 0 against what was available then.
    """
    peak = verdict.step.peak.peak_bytes
    listed = "; ".join(
        f"{remedy.label}: peak {format_bytes(remedy.peak_bytes)}, {format_bytes(peak - remedy.peak_bytes)} below the"
        f" step's {format_bytes(peak)} (" + ("fits" if verdict.remedy_fits(remedy) else "does not fit") + ", simulated)"
        for remedy in verdict.remedies
    )
    return f"replayed by preflight before step 0: {listed}"


def with_preflight_remedies(advice: list[Advice], verdict: PreflightVerdict | None) -> tuple[list[Advice], str | None]:
    """``advice`` with preflight's replayed remedies in near-capacity's list, when preflight warned with some.

    Near-capacity lists them (in place of "none measured", else after its own), and takes the best one's saving
    where it had none or a smaller one. Returns the advice and, where no near-capacity advice took them, a note
    carrying them.
    """
    if verdict is None or verdict.fits or not verdict.remedies:
        return advice, None
    text = preflight_remedies_text(verdict)
    best = min(verdict.remedies, key=lambda remedy: remedy.peak_bytes)
    saving = verdict.step.peak.peak_bytes - best.peak_bytes
    placed = False
    for index, item in enumerate(advice):
        if item.id != AdviceId.NEAR_CAPACITY:
            continue
        placed = True
        if NONE_MEASURED in item.detail:
            detail = item.detail.replace(NONE_MEASURED, text)
        else:
            detail = f"{item.detail.rstrip('.')}; {text}."
        item = replace(item, detail=detail)
        if item.estimated_saving_bytes is None or saving > item.estimated_saving_bytes:
            item = replace(
                item,
                estimated_saving_bytes=saving,
                saving_basis=SavingBasis.SIMULATED,
                predicted_peak_bytes=best.peak_bytes,
            )
        advice[index] = item
    return advice, None if placed else f"Remedies {text}"


def diagnose(
    *,
    error_text: str,
    where: str,
    step: int,
    rank: int,
    model_state: Breakdown,
    last_reading: AllocatorReading | None,
    summary: RunSummary,
    setup: TrainingSetup,
    notes: tuple[str, ...],
    snapshot: Path | None,
    simulation: Simulation | None = None,
    preflight: PreflightVerdict | None = None,
    evaluation_batch: int | None = None,
) -> OomDiagnosis:
    """Put together what was known when the error came.

    ``model_state`` holds the parts counted at the failure (``other`` unset); ``summary`` is the run so far. The
    advice is the run's own, judged as if the failing step had reached what it asked for (allocated + the failed
    request), largest saving first, with the run's replayed changes where it had them (``simulation``) and the
    remedies preflight replayed before step 0 where it warned (``preflight``: in near-capacity's list); validation
    failures get ``evaluation-batch-size`` first.
    """
    message = parse_oom_message(error_text)
    allocated = message.allocated_bytes
    if allocated is None and last_reading is not None:
        allocated = last_reading.allocated_bytes
    reserved = (
        message.allocated_bytes + message.reserved_unallocated_bytes
        if message.allocated_bytes is not None and message.reserved_unallocated_bytes is not None
        else (last_reading.reserved_bytes if last_reading is not None else None)
    )
    capacity = message.capacity_bytes or summary.device.total_bytes
    breakdown = model_state.with_measured_peak(allocated) if allocated is not None else model_state
    phase = next((candidate for candidate in Phase if candidate.value == where), None)
    judged = summary
    if phase is not None and allocated is not None:
        need = allocated + (message.tried_bytes or 0)
        failing = PhasePeak(step, phase, need, reserved, model_state.with_measured_peak(need))
        judged = replace(summary, peak=failing, device=replace(summary.device, total_bytes=capacity))
    advised, note = with_preflight_remedies(list(advise(judged, setup, simulation)), preflight)
    advice = sorted(advised, key=lambda item: -(item.estimated_saving_bytes or 0))
    if note is not None:
        notes = (*notes, note)
    if where == "validation":
        advice.insert(0, evaluation_batch_size(step, summary.peak, evaluation_batch))
    return OomDiagnosis(
        where=where,
        step=step,
        rank=rank,
        message=message,
        capacity_bytes=capacity,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        breakdown=breakdown,
        last_good_step=summary.last_step,
        advice=tuple(advice),
        notes=notes,
        snapshot=snapshot,
    )
