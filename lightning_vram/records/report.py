"""The report of one run: its summary, what was derived from it, and its JSON form both ways.

The JSON form is schema ``lightning_vram.report/1``; :func:`report_from_dict` reads back what any release wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_vram.records.advice import Advice, FitRow, NotAdvised
from lightning_vram.records.advice_json import (
    advice_from_dict,
    advice_to_dict,
    fit_row_from_dict,
    fit_row_to_dict,
    not_advised_from_dict,
    not_advised_to_dict,
)
from lightning_vram.records.json_reader import FormatError, Reader, kind_of, member, shown
from lightning_vram.records.measured import (
    DeviceInfo,
    EvaluationPeak,
    ModuleProfile,
    NotMeasured,
    Phase,
    PhasePeak,
    RunSummary,
    StepPoint,
    in_phase_order,
)
from lightning_vram.records.measured_json import (
    breakdown_from_dict,
    evaluation_from_dict,
    evaluation_to_dict,
    module_from_dict,
    phase_from_text,
    phase_peak_from_dict,
    phase_peak_to_dict,
    recomputed_units_from_dict,
    recomputed_units_to_dict,
    selective_units_from_dict,
    selective_units_to_dict,
    step_point_from_dict,
    step_point_to_dict,
)
from lightning_vram.records.shapes import BatchShapes
from lightning_vram.records.shapes_json import batch_shapes_from_dict, batch_shapes_to_dict
from lightning_vram.records.simulation import Simulation
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict

SCHEMA = "lightning_vram.report/1"


@dataclass(frozen=True)
class TimingSummary:
    """Run timing: median step in seconds, share of step time waiting for data, mean GPU utilization in percent.

    ``step_time_iqr_fraction``: the recent steps' interquartile range of step times over their median (a fraction;
    ``None``: not measured), how far their median can be trusted: a loaded machine's step times vary widely.
    """

    step_seconds_median: float | None
    data_wait_fraction: float | None
    gpu_utilization_mean: float | None
    step_time_iqr_fraction: float | None = None


@dataclass(frozen=True)
class RankSummary:
    """One process's headline: its global rank, device index and highest peak in bytes."""

    rank: int
    device_index: int | None
    peak_bytes: int | None
    steps: int


@dataclass(frozen=True)
class Report:
    """Everything the monitor learned about one run: the run's summary and what was derived from it.

    ``modules`` are the modules that saved the most activations, largest first (at most ``top_modules``).
    """

    summary: RunSummary
    precision: str | None
    modules: tuple[ModuleProfile, ...]
    advice: tuple[Advice, ...]
    fit: tuple[FitRow, ...]
    ranks: tuple[RankSummary, ...]
    not_measured: tuple[NotMeasured, ...] = field(default=())
    simulation: Simulation | None = None
    """The replay of the run's sampled step and of each change tried on it (``None`` when none ran)."""
    shapes: BatchShapes | None = None
    """The batch shapes the run saw, its largest batch and the peak replayed per length (``None``: not recorded)."""
    not_advised: tuple[NotAdvised, ...] = ()
    """The remedies the rules weighed (replayed, or measured against a threshold) and did not advise, with why."""
    ended_with: str | None = None
    """The error the run ended with, in words (:func:`error_text`); ``None``: it finished (or was not recorded)."""

    @property
    def device(self) -> DeviceInfo:
        """The monitored device."""
        return self.summary.device

    @property
    def steps(self) -> int:
        """Training batches monitored."""
        return self.summary.steps

    @property
    def optimizer_steps(self) -> int | None:
        """Optimizer steps taken, as Lightning's ``global_step`` counts them (``None``: not counted)."""
        return self.summary.optimizer_steps

    @property
    def accumulate_grad_batches(self) -> int | None:
        """Batches per optimizer step as the run was set up (``None``: not known)."""
        return self.summary.accumulate_grad_batches

    @property
    def peak(self) -> PhasePeak | None:
        """The highest phase peak of the run."""
        return self.summary.peak

    @property
    def phases(self) -> dict[Phase, PhasePeak]:
        """The highest peak of each phase."""
        return self.summary.phases

    @property
    def batch_size(self) -> int | None:
        """The batch's first dimension on the sampled step."""
        return self.summary.batch_size

    @property
    def recomputed_units(self) -> tuple[tuple[str, ...], ...] | None:
        """What activation checkpointing re-ran in backward on the sampled step, unit by unit (``None``: not recorded).

        Each unit lists the outermost modules one recomputation re-ran, in order (their names as in ``modules``).
        """
        return self.summary.recomputed_units

    @property
    def selective_units(self) -> tuple[str, ...] | None:
        """Of :attr:`recomputed_units`, those torch's selective checkpointing re-ran, by their first module.

        ``None``: not recorded (a report written before they were).
        """
        return self.summary.selective_units

    @property
    def recovered_ooms(self) -> int | None:
        """CUDA out-of-memory errors the training code caught and survived."""
        return self.summary.recovered_ooms

    @property
    def recent_peaks(self) -> tuple[StepPoint, ...]:
        """The last steps' peaks."""
        return self.summary.recent_peaks

    @property
    def evaluation(self) -> tuple[EvaluationPeak, ...]:
        """The highest evaluation-batch peak of each stage."""
        return self.summary.evaluation

    @property
    def timing(self) -> TimingSummary:
        """Step time, data wait and GPU utilization over the run."""
        summary = self.summary
        return TimingSummary(
            summary.step_seconds_median,
            summary.data_wait_fraction,
            summary.gpu_utilization_mean,
            summary.step_time_iqr_fraction,
        )

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-ready data, exactly as written to ``vram_report.json``."""
        return report_to_dict(self)


ERROR_TEXT_LIMIT = 200
"""Characters of an error's message a report keeps (its first line)."""


def error_text(error: BaseException) -> str:
    """``error`` in words for a report: its type and its message's first line, cut to :data:`ERROR_TEXT_LIMIT`.

    >>> error_text(KeyError("labels")), error_text(KeyboardInterrupt())
    ("KeyError: 'labels'", 'KeyboardInterrupt')
    """
    message = str(error).strip().partition("\n")[0]
    if len(message) > ERROR_TEXT_LIMIT:
        message = message[: ERROR_TEXT_LIMIT - 3] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def report_to_dict(report: Report) -> dict[str, Any]:
    """The report as JSON-ready data (schema ``lightning_vram.report/1``)."""
    device = report.device
    capability = device.compute_capability
    timing = report.timing
    return {
        "schema": SCHEMA,
        "device": {
            "type": device.type,
            "name": device.name,
            "index": device.index,
            "total_bytes": device.total_bytes,
            "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
        },
        "precision": report.precision,
        "steps": report.steps,
        "optimizer_steps": report.optimizer_steps,
        "accumulate_grad_batches": report.accumulate_grad_batches,
        "batch_size": report.batch_size,
        "recovered_ooms": report.recovered_ooms,
        "ended_with": report.ended_with,
        "peak": phase_peak_to_dict(report.peak, peak_key="allocated_bytes"),
        "phases": {phase.value: phase_peak_to_dict(peak) for phase, peak in in_phase_order(report.phases)},
        "modules": [
            {"name": row.name, "type": row.type, "activation_bytes": row.activation_bytes} for row in report.modules
        ],
        "recomputed_units": recomputed_units_to_dict(report.recomputed_units),
        "selective_units": selective_units_to_dict(report.selective_units),
        "timing": {
            "step_seconds_median": timing.step_seconds_median,
            "data_wait_fraction": timing.data_wait_fraction,
            "gpu_utilization_mean": timing.gpu_utilization_mean,
            "step_time_iqr_fraction": timing.step_time_iqr_fraction,
        },
        "advice": [advice_to_dict(advice) for advice in report.advice],
        "not_advised": [not_advised_to_dict(item) for item in report.not_advised],
        "fit": [fit_row_to_dict(row) for row in report.fit],
        "recent_peaks": [step_point_to_dict(point) for point in report.recent_peaks],
        "evaluation": evaluation_to_dict(report.evaluation),
        "ranks": [
            {"rank": rank.rank, "device_index": rank.device_index, "peak_bytes": rank.peak_bytes, "steps": rank.steps}
            for rank in report.ranks
        ],
        "not_measured": [{"what": item.what, "reason": item.reason} for item in report.not_measured],
        "simulation": simulation_to_dict(report.simulation, report.advice),
        "shapes": batch_shapes_to_dict(report.shapes),
    }


def _capability(text: str | None, where: str) -> tuple[int, int] | None:
    if text is None:
        return None
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()) or len(text) > 9:
        raise FormatError(f"{where} must look like '8.0', got {shown(text)}")
    return int(major), int(minor)


def _rank(data: Any, where: str) -> RankSummary:
    fields = Reader(data, where)
    return RankSummary(
        fields.integer("rank"),
        fields.optional_integer("device_index"),
        fields.optional_integer("peak_bytes"),
        fields.integer("steps"),
    )


def _not_measured(data: Any, where: str) -> NotMeasured:
    fields = Reader(data, where)
    return NotMeasured(fields.text("what"), fields.text("reason"))


def _report_phase(data: Any, where: str, phase: Phase, peak: PhasePeak | None) -> PhasePeak:
    """One entry of the report's ``phases``; ``peak`` (the run's) gives the step a file before 0.4.0 lacks."""
    fields = Reader(data, where)
    return PhasePeak(
        step=fields.added("step", Reader.integer, peak.step if peak is not None else 0),
        phase=phase,
        peak_bytes=fields.integer("peak_bytes"),
        reserved_bytes=fields.added("reserved_bytes", Reader.optional_integer, None),
        breakdown=breakdown_from_dict(fields.raw("breakdown"), f"{where}.breakdown"),
        micro_batch=fields.added("micro_batch", Reader.optional_integer, None),
    )


def report_from_dict(data: Any) -> Report:
    """Rebuild a :class:`Report` from its JSON form (what :func:`report_to_dict` wrote).

    Fields the JSON does not carry (the run's timing window, allocator retries) come back as not measured.
    Every release since 0.1.0 wrote this schema; a field a later release added reads, where a file lacks it, as:

    - 0.2.0: ``device.compute_capability``, ``precision``, ``batch_size``, ``advice[].estimated_saving_seconds``:
      ``None``; ``fit``: empty;
    - 0.3.0: ``recovered_ooms``: ``None``;
    - 0.4.0: ``recent_peaks``: empty; ``phases.<phase>.step``: the step of the run's peak (not recorded before);
    - 0.5.0: ``evaluation``: empty;
    - 0.7.0: ``phases.<phase>.reserved_bytes``: ``None`` (not measured);
    - the step replay: ``simulation``: ``None``; ``advice[].saving_basis``, ``advice[].predicted_peak_bytes``:
      ``None``; ``fit[].basis``: ``"modelled"``;
    - the batch shapes: ``shapes``: ``None``; the batch lengths: ``shapes.length_counts``: empty;
    - the recomputed units: ``recomputed_units``: ``None`` (not recorded);
    - the units recomputed selectively: ``selective_units``: ``None`` (not recorded);
    - the reasons not advised: ``not_advised``: empty;
    - the step's memory: ``simulation.timeline``, ``simulation.variants[].timeline``: ``None``;
    - the time cost: ``advice[].estimated_cost_seconds``, ``advice[].flop_ratio``, ``advice[].cost_basis``: ``None``;
    - the step time: ``advice[].predicted_step_seconds``: ``None``;
    - the step times' spread: ``timing.step_time_iqr_fraction``: ``None`` (not measured);
    - the error a run ended with: ``ended_with``: ``None`` (finished, or not recorded).
    - the optimizer steps: ``optimizer_steps``, ``accumulate_grad_batches``: ``None`` (not counted).
    - the micro-batch a peak was measured on: ``peak.micro_batch``, ``phases.<phase>.micro_batch``: ``None`` (not
      recorded; written only under gradient accumulation).

    Raises:
        FormatError: not an object of schema ``lightning_vram.report/1``, or a field is missing or mistyped.
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = shown(data.get("schema")) if isinstance(data, dict) else kind_of(data)
        raise FormatError(f"not a lightning_vram report (schema {SCHEMA!r} expected, found {found})")
    fields = Reader(data, "report")
    device = fields.child("device")
    timing = fields.child("timing")
    peak_data = fields.raw("peak")
    peak = None if peak_data is None else phase_peak_from_dict(peak_data, "peak", peak_key="allocated_bytes")
    capability = device.added("compute_capability", Reader.optional_text, None)
    summary = RunSummary(
        device=DeviceInfo(
            type=device.text("type"),
            name=device.text("name"),
            index=device.optional_integer("index"),
            total_bytes=device.optional_integer("total_bytes"),
            compute_capability=_capability(capability, "device.compute_capability"),
        ),
        peak=peak,
        phases={
            (phase := phase_from_text(name, "phases")): _report_phase(value, member("phases", name), phase, peak)
            for name, value in fields.entries("phases")
        },
        modules=tuple(fields.each("modules", module_from_dict)),
        batch_size=fields.added("batch_size", Reader.optional_integer, None),
        step_seconds_median=timing.optional_number("step_seconds_median"),
        data_wait_fraction=timing.optional_number("data_wait_fraction"),
        recent_data_wait_fraction=None,
        timed_steps=0,
        gpu_utilization_mean=timing.optional_number("gpu_utilization_mean"),
        alloc_retries=None,
        cuda_context_bytes=None,
        recovered_ooms=fields.added("recovered_ooms", Reader.optional_integer, None),
        steps=fields.integer("steps"),
        optimizer_steps=fields.added("optimizer_steps", Reader.optional_integer, None),
        accumulate_grad_batches=fields.added("accumulate_grad_batches", Reader.optional_integer, None),
        recent_peaks=tuple(fields.each("recent_peaks", step_point_from_dict)) if fields.has("recent_peaks") else (),
        evaluation=evaluation_from_dict(fields, "evaluation") if fields.has("evaluation") else (),
        recomputed_units=recomputed_units_from_dict(fields.raw("recomputed_units"), "report.recomputed_units")
        if fields.has("recomputed_units")
        else None,
        selective_units=selective_units_from_dict(fields, "report"),
        step_time_iqr_fraction=timing.added("step_time_iqr_fraction", Reader.optional_number, None),
    )
    return Report(
        summary=summary,
        precision=fields.added("precision", Reader.optional_text, None),
        modules=summary.modules,
        advice=tuple(fields.each("advice", advice_from_dict)),
        fit=tuple(fields.each("fit", fit_row_from_dict)) if fields.has("fit") else (),
        ranks=tuple(fields.each("ranks", _rank)),
        not_measured=tuple(fields.each("not_measured", _not_measured)),
        # Absent from reports written by 0.7.0 and earlier (no replay).
        simulation=simulation_from_dict(fields.raw("simulation"), "report.simulation")
        if fields.has("simulation")
        else None,
        shapes=batch_shapes_from_dict(fields.raw("shapes"), "report.shapes") if fields.has("shapes") else None,
        not_advised=tuple(fields.each("not_advised", not_advised_from_dict)) if fields.has("not_advised") else (),
        ended_with=fields.added("ended_with", Reader.optional_text, None),
    )
