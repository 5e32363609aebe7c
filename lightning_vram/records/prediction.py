""":func:`lightning_vram.predict`'s result (:class:`Prediction`), printed as a short table and written as JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_vram.records.advice import FitRow, expandable_lines
from lightning_vram.records.advice_json import fit_row_to_dict
from lightning_vram.records.budget import BudgetPlan
from lightning_vram.records.measured import CATEGORIES, in_phase_order
from lightning_vram.records.measured_json import module_to_dict
from lightning_vram.records.simulation import ReplayedStep
from lightning_vram.records.simulation_json import replayed_phases_to_dict
from lightning_vram.records.work import StepTime
from lightning_vram.units import format_bytes

MAX_NOTES = 5
"""The table lists at most this many notes; ``to_dict`` has them all."""


@dataclass(frozen=True)
class Prediction:
    """What a training step would hold, predicted without training: :func:`lightning_vram.predict`'s result.

    ``step`` is the replayed steady-state step (``None`` with ``skipped`` saying why), ``fit`` the largest batch
    predicted to fit each common GPU (with ``cuda_context_bytes`` kept free, and a safety margin where no allocator
    is simulated), ``notes`` what
    the prediction could not reproduce, ``budget`` what to checkpoint to fit a memory budget.
    """

    step: ReplayedStep | None
    fit: tuple[FitRow, ...]
    cuda_context_bytes: int
    skipped: str | None = None
    notes: tuple[str, ...] = ()
    budget: BudgetPlan | None = None
    """The checkpointing plan for ``predict(..., memory_budget=...)`` (``None``: no budget asked for)."""
    step_times: tuple[StepTime, ...] = ()
    """The step's predicted time on each common GPU of the fit table, at the replayed batch (a roofline per op at
    an assumed share of the card's published peaks, each :attr:`StepTime.basis` says; empty: not predicted)."""
    device_type: str | None = None
    """The device the prediction was asked for (``"cuda"``, ``"cpu"``); the step's own ``device_type`` is where
    the replay ran, the CPU for ``"cuda"`` on a machine that can fake no CUDA tensors (``None``: not recorded)."""

    def __str__(self) -> str:
        """A short table: each phase's predicted peak and parts, the largest batch per GPU, the notes."""
        return prediction_text(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data, in the report's forms (phases, modules, fit rows); bytes and seconds as numbers."""
        return prediction_to_dict(self)


def prediction_to_dict(prediction: Prediction) -> dict[str, Any]:
    """The prediction as JSON-ready data: the step's phases and modules as the report writes them, the fit rows."""
    step = prediction.step
    replayed = None
    if step is not None:
        peak = step.peak
        replayed = {
            "device_type": step.device_type,
            "precision": step.precision,
            "batch_size": step.batch_size,
            "peak_bytes": peak.peak_bytes,
            "peak_phase": peak.phase.value,
            "loss_activation_bytes": step.loss_activation_bytes,
            "seconds": step.seconds,
            "phases": replayed_phases_to_dict(step),
            "modules": [module_to_dict(row) for row in step.modules],
            "notes": list(step.notes),
        }
    return {
        "device_type": prediction.device_type,
        "step": replayed,
        "fit": [fit_row_to_dict(row) for row in prediction.fit],
        "cuda_context_bytes": prediction.cuda_context_bytes,
        "skipped": prediction.skipped,
        "notes": list(prediction.notes),
        "budget": prediction.budget.to_dict() if prediction.budget is not None else None,
        "step_times": [step_time_to_dict(time) for time in prediction.step_times],
    }


def step_time_to_dict(time: StepTime) -> dict[str, Any]:
    """One device's predicted step time as JSON-ready data: seconds, its parts, throughput, the assumption."""
    return {
        "device": time.device,
        "seconds": time.seconds,
        "compute_seconds": time.compute_seconds,
        "memory_seconds": time.memory_seconds,
        "overhead_seconds": time.overhead_seconds,
        "samples": time.samples,
        "samples_per_second": time.samples_per_second,
        "achieved": time.achieved,
        "calibration": time.calibration,
        "basis": time.basis,
    }


def step_time_lines(times: tuple[StepTime, ...], batch_size: int | None) -> list[str]:
    """The step times as a few lines: the assumption once, then each card's time and throughput."""
    if not times:
        return []
    batch = f" at batch {batch_size}" if batch_size is not None else ""
    lines = [
        f"Step time{batch} (roofline per op at {times[0].achieved:.0%} of each card's published peaks, ops one"
        " after another, not calibrated by a run):"
    ]
    rows = [["GPU", "step", "samples/s"]]
    for time in times:
        rate = time.samples_per_second
        rows.append([time.device, f"{1000 * time.seconds:.2f} ms", "-" if rate is None else f"{rate:,.0f}"])
    return lines + _columns(rows)


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows of cells, the first column left-aligned and the others right-aligned, two spaces apart."""
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            cell.ljust(width) if index == 0 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def prediction_text(prediction: Prediction) -> str:
    """The prediction in a few lines: each phase's predicted peak and parts, the fit rows, the notes.

    The first line answers for the device asked for. Asked for the CPU, the fit rows answer another question, which
    GPU to move the model to (from the CPU's tensor peak), and their title says so.
    """
    step = prediction.step
    if step is None:
        return f"Prediction: skipped ({prediction.skipped})"
    peak = step.peak
    batch = f", batch {step.batch_size}" if step.batch_size is not None else ""
    figure = "allocated" if step.device_type == "cuda" else "live"  # the budget's lines may give a reserved one
    asked = prediction.device_type
    device = step.device_type if asked in (None, step.device_type) else f"{asked} (replayed on {step.device_type})"
    lines = [
        f"Prediction: {device}, {step.precision}{batch}: {figure} peak {format_bytes(peak.peak_bytes)} in"
        f" {peak.phase.value}"
    ]
    header = ["phase", "peak", *(name.replace("_", " ") for name in CATEGORIES)]
    rows = [header]
    for phase, phase_peak in in_phase_order(step.phases):
        parts = phase_peak.breakdown.to_dict() if phase_peak.breakdown is not None else {}
        rows.append(
            [phase.value, format_bytes(phase_peak.peak_bytes), *(format_bytes(parts.get(name)) for name in CATEGORIES)]
        )
    lines += _columns(rows)
    if prediction.fit:
        context = prediction.cuda_context_bytes
        kept = f" (each card's capacity less {format_bytes(context)} of CUDA context)" if context else ""
        title = "Largest batch per GPU"
        if asked == "cpu":  # the CPU's answer is the first line: these rows are about moving the model
            title = "On GPUs (if you move this model there): largest batch per GPU"
        lines.append(f"{title}{kept}:")
        fit = [["GPU", "capacity", "batch", "expandable segments", "basis", "assumed"]]
        fit += [
            [
                row.device,
                format_bytes(row.capacity_bytes),
                row.batch_text,
                row.expandable_text,
                str(row.basis),
                row.allocator_text,
            ]
            for row in prediction.fit
        ]
        lines += _columns(fit)
        lines += [f"  {row.device}: {row.note}" for row in prediction.fit if row.note is not None]
        lines += [f"  {line}" for line in expandable_lines(prediction.fit)]
    lines += step_time_lines(prediction.step_times, step.batch_size)
    if prediction.budget is not None:
        lines += prediction.budget.lines()
    notes = list(dict.fromkeys((*step.notes, *prediction.notes)))  # the step's notes reach the prediction's too
    if notes:
        lines.append("Notes:")
        lines += [f"  - {note}" for note in notes[:MAX_NOTES]]
        if len(notes) > MAX_NOTES:
            lines.append(f"  ({len(notes) - MAX_NOTES} more in to_dict()['notes'])")
    return "\n".join(lines)
