"""One codec for every record the monitor writes down: the JSON report, checkpoint state and the OOM diagnosis.

Encoding gives plain Python data (dicts, lists, strings, numbers, ``None``), so a checkpoint carrying the monitor's
state loads with ``torch.load(weights_only=True)`` and a report is ``json.dumps``-able. Decoding checks every
field's type and raises :class:`FormatError` naming the field: a report or a checkpoint edited by hand, truncated
or written by something else is refused in one sentence, never half-read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_vram.records import (
    Advice,
    Attribution,
    BaselineMatch,
    BatchSizeChange,
    Breakdown,
    CheckpointChange,
    CheckpointPlan,
    DeviceInfo,
    EvaluationPeak,
    FitRow,
    FreeGradientsChange,
    InplaceChange,
    ModuleProfile,
    NotMeasured,
    OomDiagnosis,
    PartMatch,
    Phase,
    PhasePeak,
    PrecisionChange,
    RankSummary,
    ReplayedStep,
    Report,
    RunSummary,
    Simulation,
    StepChange,
    StepPoint,
    VariantResult,
)

SCHEMA = "lightning_vram.report/1"
OOM_SCHEMA = "lightning_vram.oom_report/1"
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
"""The parts of a breakdown, in the order every table shows them."""
SEVERITIES = ("critical", "warning", "info")
SAVING_BASES = ("simulated", "modelled")
"""Where an advice's byte saving, or a fit row's batch, comes from: replayed on the run's step, or a formula."""
COUNTED_PARTS = CATEGORIES[:4]
"""The parts a replay's baseline is compared with the measured step on (``other`` is not counted)."""
MAX_INTEGER = 2**63 - 1
"""The largest integer a field may hold: byte counts and steps are int64 in torch, and beyond it floats overflow."""
SHOWN_CHARACTERS = 60
"""How much of a bad value an error message quotes."""

T = TypeVar("T")


class FormatError(ValueError):
    """Data is not what the codec wrote: a field is missing, of the wrong type, or out of range."""


# ---------------------------------------------------------------------------------------------------------- encoding


def breakdown_to_dict(breakdown: Breakdown | None) -> dict[str, int | None] | None:
    """The schema's ``breakdown`` object."""
    return breakdown.to_dict() if breakdown is not None else None


def phase_peak_to_dict(peak: PhasePeak | None, peak_key: str = "peak_bytes") -> dict[str, Any] | None:
    """A phase peak; the report's top-level ``peak`` names its bytes ``allocated_bytes`` (``peak_key``)."""
    if peak is None:
        return None
    return {
        "step": peak.step,
        "phase": peak.phase.value,
        peak_key: peak.peak_bytes,
        "reserved_bytes": peak.reserved_bytes,
        "breakdown": breakdown_to_dict(peak.breakdown),
    }


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    """One piece of advice (the schema's ``advice`` entries)."""
    return {
        "id": advice.id,
        "severity": advice.severity,
        "title": advice.title,
        "detail": advice.detail,
        "evidence": advice.evidence,
        "estimated_saving_bytes": advice.estimated_saving_bytes,
        "estimated_saving_seconds": advice.estimated_saving_seconds,
        "saving_basis": advice.saving_basis,
        "predicted_peak_bytes": advice.predicted_peak_bytes,
    }


def module_to_dict(profile: ModuleProfile) -> dict[str, Any]:
    """Everything a sampled step learned about one module."""
    return {
        "name": profile.name,
        "type": profile.type,
        "activation_bytes": profile.activation_bytes,
        "input_bytes": profile.input_bytes,
        "output_bytes": profile.output_bytes,
        "inplace": profile.inplace,
        "input_saved_for_backward": profile.input_saved_for_backward,
        "input_saved_bytes": profile.input_saved_bytes,
        "output_saved_bytes": profile.output_saved_bytes,
        "output_saved_for_backward": profile.output_saved_for_backward,
        "input_feature_map": list(profile.input_feature_map) if profile.input_feature_map is not None else None,
    }


def attribution_to_dict(attribution: Attribution | None) -> dict[str, Any] | None:
    """A sampled step's counts."""
    if attribution is None:
        return None
    return {
        "step": attribution.step,
        "phases": {phase.value: breakdown_to_dict(parts) for phase, parts in attribution.phases.items()},
        "modules": [module_to_dict(profile) for profile in attribution.modules],
        "batch_size": attribution.batch_size,
    }


def evaluation_to_dict(peaks: tuple[EvaluationPeak, ...]) -> dict[str, Any]:
    """Evaluation peaks by stage."""
    return {
        peak.stage: {
            "peak_bytes": peak.peak_bytes,
            "reserved_bytes": peak.reserved_bytes,
            "after_step": peak.after_step,
        }
        for peak in peaks
    }


def step_point_to_dict(point: StepPoint) -> dict[str, int]:
    """One recent step's peak."""
    return {"step": point.step, "peak_bytes": point.peak_bytes}


def change_kind(change: StepChange) -> str:
    """The name the report gives a change's kind."""
    if isinstance(change, PrecisionChange):
        return "precision"
    if isinstance(change, CheckpointChange):
        return "checkpoint"
    if isinstance(change, InplaceChange):
        return "inplace"
    if isinstance(change, FreeGradientsChange):
        return "free-gradients"
    return "batch-size"


def change_parameters(change: StepChange) -> dict[str, Any]:
    """What the change sets, enough to rebuild it (the checkpointing plan whole)."""
    if isinstance(change, PrecisionChange):
        return {"precision": change.precision}
    if isinstance(change, CheckpointChange):
        plan = change.plan
        return {
            "container": plan.container,
            "units": [list(unit) for unit in plan.units],
            "sequential_segments": plan.sequential_segments,
            "forward_of": plan.forward_of,
            "modelled_saving_bytes": plan.saving_bytes,
        }
    if isinstance(change, InplaceChange):
        return {"modules": list(change.modules)}
    if isinstance(change, FreeGradientsChange):
        return {}
    return {"batch_size": change.batch_size}


def replayed_phases_to_dict(step: ReplayedStep) -> dict[str, Any]:
    """A replayed step's phases: each one's predicted allocator peak and counted parts."""
    return {
        phase.value: {"peak_bytes": peak.peak_bytes, "breakdown": breakdown_to_dict(peak.breakdown)}
        for phase, peak in in_phase_order(step.phases)
    }


def variant_to_dict(variant: VariantResult) -> dict[str, Any]:
    """One change tried by replay: its predicted peak (as the report measures peaks) and parts, or why discarded."""
    replayed = variant.replayed
    peak = replayed.reported_peak if replayed is not None else None
    return {
        "change": variant.change.label,
        "kind": change_kind(variant.change),
        "parameters": change_parameters(variant.change),
        "predicted_peak_bytes": replayed.reported_bytes(peak) if replayed is not None and peak is not None else None,
        "peak_phase": peak.phase.value if peak is not None else None,
        "breakdown": breakdown_to_dict(peak.breakdown) if peak is not None else None,
        "phases": replayed_phases_to_dict(replayed) if replayed is not None else None,
        "discarded": variant.discarded,
    }


def baseline_match_to_dict(match: BaselineMatch | None) -> dict[str, Any] | None:
    """The replayed baseline against the measured step, part by part."""
    if match is None:
        return None
    return {
        "step": match.step,
        "matches": match.matches,
        "tolerance": match.tolerance,
        "parts": [
            {
                "phase": part.phase.value,
                "part": part.part,
                "measured_bytes": part.measured_bytes,
                "replayed_bytes": part.replayed_bytes,
            }
            for part in match.parts
        ],
    }


def simulation_to_dict(simulation: Simulation | None) -> dict[str, Any] | None:
    """The report's ``simulation`` section: the replayed baseline, its match, and each change tried."""
    if simulation is None:
        return None
    baseline = simulation.baseline
    peak = baseline.reported_peak if baseline is not None and baseline.phases else None
    return {
        "device_type": simulation.device_type,
        "seconds": simulation.seconds,
        "skipped": simulation.skipped,
        "step": next(iter(baseline.phases.values())).step if baseline is not None and baseline.phases else None,
        "precision": baseline.precision if baseline is not None else None,
        "batch_size": baseline.batch_size if baseline is not None else None,
        "peak_bytes": baseline.reported_bytes(peak) if baseline is not None and peak is not None else None,
        "peak_phase": peak.phase.value if peak is not None else None,
        "loss_activation_bytes": baseline.loss_activation_bytes if baseline is not None else None,
        "notes": list(baseline.notes) if baseline is not None else [],
        "baseline": baseline_match_to_dict(simulation.match),
        "phases": replayed_phases_to_dict(baseline) if baseline is not None else None,
        "device_max_batch_size": simulation.device_max_batch_size,
        "variants": [variant_to_dict(variant) for variant in simulation.variants],
    }


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
        "batch_size": report.batch_size,
        "recovered_ooms": report.recovered_ooms,
        "peak": phase_peak_to_dict(report.peak, peak_key="allocated_bytes"),
        "phases": {phase.value: phase_peak_to_dict(peak) for phase, peak in in_phase_order(report.phases)},
        "modules": [
            {"name": row.name, "type": row.type, "activation_bytes": row.activation_bytes} for row in report.modules
        ],
        "timing": {
            "step_seconds_median": timing.step_seconds_median,
            "data_wait_fraction": timing.data_wait_fraction,
            "gpu_utilization_mean": timing.gpu_utilization_mean,
        },
        "advice": [advice_to_dict(advice) for advice in report.advice],
        "fit": [
            {
                "device": row.device,
                "capacity_bytes": row.capacity_bytes,
                "max_batch_size": row.max_batch_size,
                "basis": row.basis,
                "at_least": row.at_least,
            }
            for row in report.fit
        ],
        "recent_peaks": [step_point_to_dict(point) for point in report.recent_peaks],
        "evaluation": evaluation_to_dict(report.evaluation),
        "ranks": [
            {"rank": rank.rank, "device_index": rank.device_index, "peak_bytes": rank.peak_bytes, "steps": rank.steps}
            for rank in report.ranks
        ],
        "not_measured": [{"what": item.what, "reason": item.reason} for item in report.not_measured],
        "simulation": simulation_to_dict(report.simulation),
    }


def oom_diagnosis_to_dict(diagnosis: OomDiagnosis, headline: str) -> dict[str, Any]:
    """JSON-ready form of a diagnosis, as written to ``vram_oom_report.json``."""
    return {
        "schema": OOM_SCHEMA,
        "headline": headline,
        "where": diagnosis.where,
        "step": diagnosis.step,
        "rank": diagnosis.rank,
        "tried_bytes": diagnosis.message.tried_bytes,
        "free_bytes": diagnosis.message.free_bytes,
        "needed_more_bytes": diagnosis.needed_more_bytes,
        "capacity_bytes": diagnosis.capacity_bytes,
        "allocated_bytes": diagnosis.allocated_bytes,
        "reserved_bytes": diagnosis.reserved_bytes,
        "process_bytes": diagnosis.message.process_bytes,
        "breakdown": breakdown_to_dict(diagnosis.breakdown),
        "last_good_step": [phase_peak_to_dict(peak) for peak in diagnosis.last_good_step],
        "advice": [advice_to_dict(item) for item in diagnosis.advice],
        "notes": list(diagnosis.notes),
        "snapshot": str(diagnosis.snapshot) if diagnosis.snapshot is not None else None,
    }


def in_phase_order(phases: dict[Phase, PhasePeak]) -> list[tuple[Phase, PhasePeak]]:
    """The phases present, in the order a training step runs them."""
    return [(phase, phases[phase]) for phase in Phase if phase in phases]


# ---------------------------------------------------------------------------------------------------------- decoding


class Reader:
    """Typed access to one JSON object, naming the field (``where.key``) in every error."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise FormatError(f"{where} must be an object, got {_kind(data)}")
        self._data = data
        self._where = where

    def has(self, key: str) -> bool:
        """Whether the object has the field (fields added in later versions are absent from older files)."""
        return key in self._data

    def added(self, key: str, read: Callable[[Reader, str], T], default: T) -> T:
        """A field a later release added: ``read(self, key)``, or ``default`` where an older file lacks it.

        >>> Reader({"steps": 3}, "report").added("precision", Reader.optional_text, None) is None
        True
        """
        return read(self, key) if key in self._data else default

    def raw(self, key: str) -> Any:
        """The field's value as it is (its type unchecked)."""
        if key not in self._data:
            raise FormatError(f"{self._where}: missing field {key!r}")
        return self._data[key]

    def _path(self, key: str) -> str:
        return member(self._where, key)

    def integer(self, key: str, minimum: int | None = 0) -> int:
        """An integer field (bools refused), at least ``minimum``."""
        return _as_int(self.raw(key), self._path(key), minimum)

    def optional_integer(self, key: str, minimum: int | None = 0) -> int | None:
        """An integer field or ``null``."""
        value = self.raw(key)
        return None if value is None else _as_int(value, self._path(key), minimum)

    def optional_number(self, key: str, minimum: float | None = 0.0) -> float | None:
        """A finite number or ``null``."""
        value = self.raw(key)
        return None if value is None else _as_float(value, self._path(key), minimum)

    def number(self, key: str, minimum: float | None = 0.0) -> float:
        """A finite number."""
        return _as_float(self.raw(key), self._path(key), minimum)

    def text(self, key: str) -> str:
        """A string field."""
        value = self.raw(key)
        if not isinstance(value, str):
            raise FormatError(f"{self._path(key)} must be a string, got {_kind(value)}")
        return value

    def optional_text(self, key: str) -> str | None:
        """A string field or ``null``."""
        return None if self.raw(key) is None else self.text(key)

    def optional_flag(self, key: str) -> bool | None:
        """``true``, ``false`` or ``null``."""
        value = self.raw(key)
        if value is not None and not isinstance(value, bool):
            raise FormatError(f"{self._path(key)} must be true, false or null, got {_kind(value)}")
        return value

    def flag(self, key: str) -> bool:
        """``true`` or ``false``."""
        value = self.optional_flag(key)
        if value is None:
            raise FormatError(f"{self._path(key)} must be true or false, got null")
        return value

    def child(self, key: str) -> Reader:
        """A nested object."""
        return Reader(self.raw(key), self._path(key))

    def optional_child(self, key: str) -> Reader | None:
        """A nested object or ``null``."""
        value = self.raw(key)
        return None if value is None else Reader(value, self._path(key))

    def entries(self, key: str) -> list[tuple[str, Any]]:
        """The entries of a nested object."""
        value = self.raw(key)
        if not isinstance(value, dict):
            raise FormatError(f"{self._path(key)} must be an object, got {_kind(value)}")
        return list(value.items())

    def texts(self, key: str) -> list[str]:
        """A list of strings."""
        return _text_list(self.raw(key), self._path(key))

    def each(self, key: str, decode: Callable[[Any, str], T]) -> list[T]:
        """A list field, each item decoded by ``decode(item, where)``."""
        value = self.raw(key)
        if not isinstance(value, list):
            raise FormatError(f"{self._path(key)} must be a list, got {_kind(value)}")
        return [decode(item, f"{self._path(key)}[{index}]") for index, item in enumerate(value)]


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def shown(value: Any) -> str:
    """``repr(value)``, shortened to :data:`SHOWN_CHARACTERS`: an error message quotes a bad value, not a file.

    >>> print(shown("x" * 100), shown([1, 2]))
    'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx… a list of length 2
    """
    if isinstance(value, (list, dict)):
        return f"a {_kind(value)} of length {len(value)}"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 1] + "…"


def member(where: str, key: str) -> str:
    r"""The path of ``key`` in ``where`` for an error message: ``where.key``, or ``where['odd key']``.

    >>> print(member("evaluation", "validation"), member("evaluation", "a.b\nc"))
    evaluation.validation evaluation['a.b\nc']
    """
    if key.isidentifier() and key.isascii():
        return f"{where}.{key}"
    return f"{where}[{shown(key)}]"


def _as_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{where} must be a string, got {_kind(value)}")
    return value


def _text_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise FormatError(f"{where} must be a list, got {_kind(value)}")
    return [_as_text(item, f"{where}[{index}]") for index, item in enumerate(value)]


def _one_of(value: str | None, choices: tuple[str, ...], where: str) -> str | None:
    if value is not None and value not in choices:
        raise FormatError(f"{where} must be one of {list(choices)} or null, got {shown(value)}")
    return value


def _as_int(value: Any, where: str, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where} must be an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {shown(value)}")
    if value > MAX_INTEGER:
        raise FormatError(f"{where} must be at most 2**63 - 1, got {shown(value)}")
    return value


def _as_float(value: Any, where: str, minimum: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FormatError(f"{where} must be a number, got {_kind(value)}")
    if (isinstance(value, int) and abs(value) > MAX_INTEGER) or not math.isfinite(value):
        raise FormatError(f"{where} must be a finite number, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {shown(value)}")
    return float(value)


def _phase(text: str, where: str) -> Phase:
    try:
        return Phase(text)
    except ValueError:
        raise FormatError(f"{where} must be one of {[phase.value for phase in Phase]}, got {shown(text)}") from None


def breakdown_from_dict(data: Any, where: str) -> Breakdown | None:
    """The breakdown :func:`breakdown_to_dict` wrote."""
    if data is None:
        return None
    fields = Reader(data, where)
    return Breakdown(
        parameters=fields.integer("parameters"),
        gradients=fields.integer("gradients"),
        optimizer_state=fields.integer("optimizer_state"),
        activations=fields.integer("activations"),
        other=fields.optional_integer("other"),
    )


def phase_peak_from_dict(data: Any, where: str, peak_key: str = "peak_bytes") -> PhasePeak:
    """The phase peak :func:`phase_peak_to_dict` wrote."""
    fields = Reader(data, where)
    return PhasePeak(
        step=fields.integer("step"),
        phase=_phase(fields.text("phase"), f"{where}.phase"),
        peak_bytes=fields.integer(peak_key),
        reserved_bytes=fields.optional_integer("reserved_bytes"),
        breakdown=breakdown_from_dict(fields.raw("breakdown"), f"{where}.breakdown"),
    )


def optional_phase_peak_from_dict(data: Any, where: str) -> PhasePeak | None:
    """A phase peak or ``null``."""
    return None if data is None else phase_peak_from_dict(data, where)


def step_pair_from_list(data: Any, where: str) -> tuple[int, int]:
    """A ``[step, peak_bytes]`` pair (the compact form checkpoint state keeps recent peaks in)."""
    if not isinstance(data, list) or len(data) != 2:
        raise FormatError(f"{where} must be [step, peak_bytes], got {_kind(data)}")
    return _as_int(data[0], f"{where}[0]", 0), _as_int(data[1], f"{where}[1]", 0)


def advice_from_dict(data: Any, where: str) -> Advice:
    """The advice :func:`advice_to_dict` wrote."""
    fields = Reader(data, where)
    severity = fields.text("severity")
    if severity not in SEVERITIES:
        raise FormatError(f"{where}.severity must be one of {list(SEVERITIES)}, got {shown(severity)}")
    return Advice(
        id=fields.text("id"),
        severity=severity,
        title=fields.text("title"),
        detail=fields.text("detail"),
        evidence=fields.text("evidence"),
        estimated_saving_bytes=fields.optional_integer("estimated_saving_bytes", minimum=None),
        estimated_saving_seconds=fields.added(
            "estimated_saving_seconds", lambda reader, key: reader.optional_number(key, minimum=None), None
        ),
        # Both absent from reports written by 0.7.0 and earlier.
        saving_basis=(
            _one_of(fields.optional_text("saving_basis"), SAVING_BASES, f"{where}.saving_basis")
            if fields.has("saving_basis")
            else None
        ),
        predicted_peak_bytes=fields.optional_integer("predicted_peak_bytes")
        if fields.has("predicted_peak_bytes")
        else None,
    )


def module_from_dict(data: Any, where: str) -> ModuleProfile:
    """A module profile: the report's three fields, or all of them as :func:`module_to_dict` wrote."""
    fields = Reader(data, where)
    name, type_name, saved = fields.text("name"), fields.text("type"), fields.integer("activation_bytes")
    if "input_bytes" not in data:  # the report lists only what a reader needs
        return ModuleProfile(name, type_name, saved)
    return ModuleProfile(
        name=name,
        type=type_name,
        activation_bytes=saved,
        input_bytes=fields.integer("input_bytes"),
        output_bytes=fields.integer("output_bytes"),
        inplace=fields.optional_flag("inplace"),
        input_saved_for_backward=fields.flag("input_saved_for_backward"),
        input_saved_bytes=fields.integer("input_saved_bytes"),
        output_saved_bytes=fields.integer("output_saved_bytes"),
        output_saved_for_backward=fields.flag("output_saved_for_backward"),
        input_feature_map=_feature_map(fields.raw("input_feature_map"), f"{where}.input_feature_map"),
    )


def _feature_map(data: Any, where: str) -> tuple[int, int] | None:
    if data is None:
        return None
    if not isinstance(data, list) or len(data) != 2:
        raise FormatError(f"{where} must be [channels, positions] or null, got {_kind(data)}")
    return _as_int(data[0], f"{where}[0]", 1), _as_int(data[1], f"{where}[1]", 1)


def attribution_from_dict(data: Any, where: str) -> Attribution | None:
    """The counts :func:`attribution_to_dict` wrote."""
    if data is None:
        return None
    fields = Reader(data, where)
    phases = {}
    for name, parts in fields.entries("phases"):
        breakdown = breakdown_from_dict(parts, member(f"{where}.phases", name))
        if breakdown is not None:
            phases[_phase(name, f"{where}.phases")] = breakdown
    return Attribution(
        step=fields.integer("step"),
        phases=phases,
        modules=tuple(fields.each("modules", module_from_dict)),
        batch_size=fields.optional_integer("batch_size"),
    )


def evaluation_from_dict(fields: Reader, key: str) -> tuple[EvaluationPeak, ...]:
    """Evaluation peaks by stage, as :func:`evaluation_to_dict` wrote them."""
    peaks = []
    for stage, value in fields.entries(key):
        peak = Reader(value, member(key, stage))
        peaks.append(
            EvaluationPeak(
                stage, peak.integer("peak_bytes"), peak.integer("reserved_bytes"), peak.integer("after_step")
            )
        )
    return tuple(peaks)


def step_point_from_dict(data: Any, where: str) -> StepPoint:
    """One recent step's peak."""
    fields = Reader(data, where)
    return StepPoint(fields.integer("step"), fields.integer("peak_bytes"))


def _capability(text: str | None, where: str) -> tuple[int, int] | None:
    if text is None:
        return None
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()) or len(text) > 9:
        raise FormatError(f"{where} must look like '8.0', got {shown(text)}")
    return int(major), int(minor)


def _fit_row(data: Any, where: str) -> FitRow:
    fields = Reader(data, where)
    basis = fields.text("basis") if fields.has("basis") else "modelled"  # absent up to 0.7.0: extrapolated
    if basis not in SAVING_BASES:
        raise FormatError(f"{where}.basis must be one of {list(SAVING_BASES)}, got {shown(basis)}")
    at_least = fields.flag("at_least") if fields.has("at_least") else False  # absent up to 0.7.0: exact
    return FitRow(
        fields.text("device"), fields.integer("capacity_bytes"), fields.integer("max_batch_size"), basis, at_least
    )


def _change(kind: str, parameters: Reader, where: str) -> StepChange:
    """The change :func:`change_kind` and :func:`change_parameters` described."""
    if kind == "precision":
        return PrecisionChange(parameters.text("precision"))
    if kind == "checkpoint":
        units = parameters.each("units", lambda unit, at: tuple(_text_list(unit, at)))
        plan = CheckpointPlan(
            container=parameters.text("container"),
            units=tuple(units),
            sequential_segments=parameters.optional_integer("sequential_segments", minimum=1),
            saving_bytes=parameters.integer("modelled_saving_bytes", minimum=None),
            forward_of=parameters.optional_text("forward_of"),
        )
        return CheckpointChange(plan)
    if kind == "inplace":
        return InplaceChange(tuple(parameters.texts("modules")))
    if kind == "free-gradients":
        return FreeGradientsChange()
    if kind == "batch-size":
        return BatchSizeChange(parameters.integer("batch_size", minimum=1))
    kinds = ["precision", "checkpoint", "inplace", "free-gradients", "batch-size"]
    raise FormatError(f"{where}.kind must be one of {kinds}, got {shown(kind)}")


def _replayed_phases(fields: Reader, key: str, step: int) -> dict[Phase, PhasePeak]:
    phases = {}
    for name, value in fields.entries(key):
        where = member(key, name)
        phase = _phase(name, key)
        peak = Reader(value, where)
        breakdown = breakdown_from_dict(peak.raw("breakdown"), f"{where}.breakdown")
        phases[phase] = PhasePeak(step, phase, peak.integer("peak_bytes"), None, breakdown)
    return phases


def _part_match(data: Any, where: str) -> PartMatch:
    fields = Reader(data, where)
    part = fields.text("part")
    if part not in COUNTED_PARTS:
        raise FormatError(f"{where}.part must be one of {list(COUNTED_PARTS)}, got {shown(part)}")
    return PartMatch(
        _phase(fields.text("phase"), f"{where}.phase"),
        part,
        fields.integer("measured_bytes"),
        fields.integer("replayed_bytes"),
    )


def _baseline_match(fields: Reader | None) -> BaselineMatch | None:
    if fields is None:
        return None
    fields.flag("matches")  # derived from the parts; checked for its type only
    return BaselineMatch(
        step=fields.integer("step"),
        parts=tuple(fields.each("parts", _part_match)),
        tolerance=fields.number("tolerance"),
    )


def _variant(data: Any, where: str, baseline: ReplayedStep) -> VariantResult:
    """One change tried; its replayed step takes what the JSON leaves out (precision, batch) from ``baseline``."""
    fields = Reader(data, where)
    fields.text("change")  # the change's label, derived from it
    change = _change(fields.text("kind"), fields.child("parameters"), where)
    fields.optional_integer("predicted_peak_bytes")  # derived from the phases
    _phase_or_none(fields.optional_text("peak_phase"), f"{where}.peak_phase")  # derived
    breakdown_from_dict(fields.raw("breakdown"), f"{where}.breakdown")  # derived
    discarded = fields.optional_text("discarded")
    if fields.raw("phases") is None:
        if discarded is None:
            raise FormatError(f"{where}: a change neither replayed (phases) nor discarded")
        return VariantResult(change, None, discarded)
    step = next(iter(baseline.phases.values())).step if baseline.phases else 0
    replayed = ReplayedStep(
        device_type=baseline.device_type,
        precision=change.precision if isinstance(change, PrecisionChange) else baseline.precision,
        batch_size=change.batch_size if isinstance(change, BatchSizeChange) else baseline.batch_size,
        phases=_replayed_phases(fields, "phases", step),
        modules=(),
        loss_activation_bytes=0,
        seconds=0.0,
    )
    return VariantResult(change, replayed, discarded)


def simulation_from_dict(data: Any, where: str = "simulation") -> Simulation | None:
    """The simulation :func:`simulation_to_dict` wrote (``None`` for null), as checkpoint state carries it."""
    return None if data is None else _simulation(Reader(data, where))


def _simulation(fields: Reader | None) -> Simulation | None:
    """The ``simulation`` section :func:`simulation_to_dict` wrote; its derived fields are checked for type only."""
    if fields is None:
        return None
    device_type = fields.text("device_type")
    step = fields.optional_integer("step")
    fields.optional_integer("peak_bytes")  # derived from the phases
    _phase_or_none(fields.optional_text("peak_phase"), "simulation.peak_phase")  # derived
    baseline = None
    if fields.raw("phases") is not None:
        baseline = ReplayedStep(
            device_type=device_type,
            precision=fields.text("precision"),
            batch_size=fields.optional_integer("batch_size"),
            phases=_replayed_phases(fields, "phases", step or 0),
            modules=(),
            loss_activation_bytes=fields.integer("loss_activation_bytes"),
            seconds=0.0,
            notes=tuple(fields.texts("notes")),
        )
    # A variant is replayed against the baseline; without one (skipped), none can have been.
    context = baseline or ReplayedStep(device_type, "", None, {}, (), 0, 0.0)
    return Simulation(
        device_type=device_type,
        baseline=baseline,
        match=_baseline_match(fields.optional_child("baseline")),
        skipped=fields.optional_text("skipped"),
        variants=tuple(fields.each("variants", lambda data, where: _variant(data, where, context))),
        seconds=fields.number("seconds"),
        device_max_batch_size=fields.optional_integer("device_max_batch_size"),
    )


def _phase_or_none(text: str | None, where: str) -> Phase | None:
    return None if text is None else _phase(text, where)


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
      ``None``; ``fit[].basis``: ``"modelled"``.

    Raises:
        FormatError: not an object of schema ``lightning_vram.report/1``, or a field is missing or mistyped.
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = shown(data.get("schema")) if isinstance(data, dict) else _kind(data)
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
            (phase := _phase(name, "phases")): _report_phase(value, member("phases", name), phase, peak)
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
        recent_peaks=tuple(fields.each("recent_peaks", step_point_from_dict)) if fields.has("recent_peaks") else (),
        evaluation=evaluation_from_dict(fields, "evaluation") if fields.has("evaluation") else (),
    )
    return Report(
        summary=summary,
        precision=fields.added("precision", Reader.optional_text, None),
        modules=summary.modules,
        advice=tuple(fields.each("advice", advice_from_dict)),
        fit=tuple(fields.each("fit", _fit_row)) if fields.has("fit") else (),
        ranks=tuple(fields.each("ranks", _rank)),
        not_measured=tuple(fields.each("not_measured", _not_measured)),
        # Absent from reports written by 0.7.0 and earlier (no replay).
        simulation=_simulation(fields.optional_child("simulation")) if fields.has("simulation") else None,
    )
