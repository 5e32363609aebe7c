"""The JSON form of measured records, both ways: the report's pieces and the tracker's checkpoint state."""

from __future__ import annotations

from typing import Any

from lightning_vram.records.json_reader import (
    MAX_INTEGER,
    FormatError,
    Reader,
    as_int,
    kind_of,
    member,
    shown,
    text_list,
)
from lightning_vram.records.measured import (
    Attribution,
    Breakdown,
    EvaluationPeak,
    ModuleProfile,
    Phase,
    PhasePeak,
    StepPoint,
)


def breakdown_to_dict(breakdown: Breakdown | None) -> dict[str, int | None] | None:
    """The schema's ``breakdown`` object."""
    return breakdown.to_dict() if breakdown is not None else None


def phase_peak_to_dict(peak: PhasePeak | None, peak_key: str = "peak_bytes") -> dict[str, Any] | None:
    """A phase peak; the report's top-level ``peak`` names its bytes ``allocated_bytes`` (``peak_key``)."""
    if peak is None:
        return None
    data = {
        "step": peak.step,
        "phase": peak.phase.value,
        peak_key: peak.peak_bytes,
        "reserved_bytes": peak.reserved_bytes,
        "breakdown": breakdown_to_dict(peak.breakdown),
    }
    if peak.micro_batch is not None:  # under gradient accumulation only
        data["micro_batch"] = peak.micro_batch
    return data


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
        "calls": profile.calls,
        "input_feature_map_dims": profile.input_feature_map_dims,
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
        "recomputed_units": recomputed_units_to_dict(attribution.recomputed_units),
        "selective_units": selective_units_to_dict(attribution.selective_units),
        "micro_batch": attribution.micro_batch,
    }


def recomputed_units_to_dict(units: tuple[tuple[str, ...], ...] | None) -> list[list[str]] | None:
    """The modules each recomputed unit re-ran, unit by unit (``None``: not recorded)."""
    return None if units is None else [list(unit) for unit in units]


def recomputed_units_from_dict(data: Any, where: str) -> tuple[tuple[str, ...], ...] | None:
    """The units :func:`recomputed_units_to_dict` wrote.

    >>> recomputed_units_from_dict([["net.0", "net.1"], ["net.2.block"]], "report.recomputed_units")
    (('net.0', 'net.1'), ('net.2.block',))
    """
    if data is None:
        return None
    if not isinstance(data, list):
        raise FormatError(f"{where} must be a list, got {kind_of(data)}")
    return tuple(tuple(text_list(unit, f"{where}[{index}]")) for index, unit in enumerate(data))


def selective_units_to_dict(units: tuple[str, ...] | None) -> list[str] | None:
    """The first module of each unit selective checkpointing re-ran (``None``: not recorded)."""
    return None if units is None else list(units)


def selective_units_from_dict(fields: Reader, where: str) -> tuple[str, ...] | None:
    """The units :func:`selective_units_to_dict` wrote, ``None`` where null or absent (written before they were).

    >>> selective_units_from_dict(Reader({"selective_units": ["net.2.block"]}, "report"), "report")
    ('net.2.block',)
    >>> selective_units_from_dict(Reader({}, "report"), "report") is None
    True
    """
    data = fields.raw("selective_units") if fields.has("selective_units") else None
    return None if data is None else tuple(text_list(data, f"{where}.selective_units"))


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


def phase_from_text(text: str, where: str) -> Phase:
    """The phase a JSON string at ``where`` names."""
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
        phase=phase_from_text(fields.text("phase"), f"{where}.phase"),
        peak_bytes=fields.integer(peak_key),
        reserved_bytes=fields.optional_integer("reserved_bytes"),
        breakdown=breakdown_from_dict(fields.raw("breakdown"), f"{where}.breakdown"),
        micro_batch=fields.added("micro_batch", Reader.optional_integer, None),
    )


def optional_phase_peak_from_dict(data: Any, where: str) -> PhasePeak | None:
    """A phase peak or ``null``."""
    return None if data is None else phase_peak_from_dict(data, where)


def step_pair_from_list(data: Any, where: str) -> tuple[int, int]:
    """A ``[step, peak_bytes]`` pair (the compact form checkpoint state keeps recent peaks in)."""
    if not isinstance(data, list) or len(data) != 2:
        raise FormatError(f"{where} must be [step, peak_bytes], got {kind_of(data)}")
    return as_int(data[0], f"{where}[0]", 0), as_int(data[1], f"{where}[1]", 0)


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
        calls=fields.added("calls", Reader.integer, 1),
        input_feature_map_dims=fields.added("input_feature_map_dims", Reader.optional_integer, None),
    )


def _feature_map(data: Any, where: str) -> tuple[int, int] | None:
    if data is None:
        return None
    if not isinstance(data, list) or len(data) != 2:
        raise FormatError(f"{where} must be [channels, positions] or null, got {kind_of(data)}")
    return as_int(data[0], f"{where}[0]", 1), as_int(data[1], f"{where}[1]", 1)


def attribution_from_dict(data: Any, where: str) -> Attribution | None:
    """The counts :func:`attribution_to_dict` wrote."""
    if data is None:
        return None
    fields = Reader(data, where)
    phases = {}
    for name, parts in fields.entries("phases"):
        breakdown = breakdown_from_dict(parts, member(f"{where}.phases", name))
        if breakdown is not None:
            phases[phase_from_text(name, f"{where}.phases")] = breakdown
    return Attribution(
        step=fields.integer("step"),
        phases=phases,
        modules=tuple(fields.each("modules", module_from_dict)),
        batch_size=fields.optional_integer("batch_size"),
        recomputed_units=recomputed_units_from_dict(fields.raw("recomputed_units"), f"{where}.recomputed_units")
        if fields.has("recomputed_units")
        else None,
        selective_units=selective_units_from_dict(fields, where),
        micro_batch=fields.added("micro_batch", Reader.optional_integer, None),
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
    """One recent step's peak.

    A report holds up to :data:`~lightning_vram.config.MAX_RECENT_STEPS` of them (a million): a well-formed one is
    taken as it is, without a :class:`Reader` (a report of a million read back in 2.1 CPU s, was 3.7); any other is
    read field by field, so a bad one is refused as every field is.
    """
    if type(data) is dict:
        step, peak = data.get("step"), data.get("peak_bytes")
        if type(step) is int and type(peak) is int and 0 <= step <= MAX_INTEGER and 0 <= peak <= MAX_INTEGER:
            return StepPoint(step, peak)
    fields = Reader(data, where)
    return StepPoint(fields.integer("step"), fields.integer("peak_bytes"))
