"""The JSON form of a simulation, both ways: the report's ``simulation`` section and the session's checkpoint state.

A replayed step's derived fields (its peak, the change's label) are written for readers and, read back, checked for
their type only.
"""

from __future__ import annotations

from typing import Any

from lightning_vram.records.advice import Advice, CheckpointPlan
from lightning_vram.records.json_reader import FormatError, Reader, as_int, member, member_of, shown, text_list
from lightning_vram.records.measured import MATCHED_PARTS, Phase, PhasePeak, in_phase_order
from lightning_vram.records.measured_json import breakdown_from_dict, breakdown_to_dict, phase_from_text
from lightning_vram.records.simulation import (
    BaselineMatch,
    BatchSizeChange,
    Calibration,
    ChangeKind,
    CheckpointChange,
    FreeGradientsChange,
    InplaceChange,
    LengthChange,
    OffloadTrial,
    PartMatch,
    PhaseCalibration,
    PrecisionChange,
    ReplayedStep,
    ShardingTrial,
    Simulation,
    StepChange,
    StrategyBuffers,
    TokensPerBatchChange,
    VariantResult,
    advised_variant,
)
from lightning_vram.records.timeline_json import timeline_from_dict, timeline_to_dict


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
            "switch": plan.switch,
            "selective": list(plan.selective),
            "shared": list(plan.shared),
        }
    if isinstance(change, InplaceChange):
        return {"modules": list(change.modules)}
    if isinstance(change, FreeGradientsChange):
        return {}
    if isinstance(change, LengthChange):
        return {"length": change.length}
    if isinstance(change, TokensPerBatchChange):
        return {"tokens": change.tokens}
    return {"batch_size": change.batch_size}


def replayed_phases_to_dict(step: ReplayedStep) -> dict[str, Any]:
    """A replayed step's phases: each one's predicted allocator peak and counted parts."""
    return _phases_to_dict(step.phases)


def _phases_to_dict(phases: dict[Phase, PhasePeak]) -> dict[str, Any]:
    return {
        phase.value: {"peak_bytes": peak.peak_bytes, "breakdown": breakdown_to_dict(peak.breakdown)}
        for phase, peak in in_phase_order(phases)
    }


def variant_to_dict(variant: VariantResult, timeline: bool = False) -> dict[str, Any]:
    """One change tried by replay: its predicted peak (as the report measures peaks) and parts, or why discarded.

    With ``timeline``, also its memory op by op (``null`` where not recorded); without, the field is left out.
    Under gradient accumulation, also the phases of the window's first micro-batch (``window_first``, beside
    ``phases``, the steady one's): what a run measuring a first micro-batch is set against.
    """
    replayed = variant.replayed
    peak = replayed.reported_peak if replayed is not None and replayed.phases else None
    timelines = {"timeline": timeline_to_dict(replayed.timeline if replayed else None)} if timeline else {}
    first = replayed.window_first if replayed is not None else None
    return {
        "change": variant.change.label,
        "kind": str(variant.change.kind),
        "parameters": change_parameters(variant.change),
        "predicted_peak_bytes": replayed.reported_bytes(peak) if replayed is not None and peak is not None else None,
        "peak_phase": peak.phase.value if peak is not None else None,
        "breakdown": breakdown_to_dict(peak.breakdown) if peak is not None else None,
        "phases": replayed_phases_to_dict(replayed) if replayed is not None else None,
        "discarded": variant.discarded,
        **({"window_first": _phases_to_dict(first)} if first is not None else {}),
        **timelines,
    }


def baseline_match_to_dict(match: BaselineMatch | None) -> dict[str, Any] | None:
    """The replayed baseline against the measured step, part by part."""
    if match is None:
        return None
    return {
        "step": match.step,
        "matches": match.matches,
        "tolerance": match.tolerance,
        **({"window_first": True} if match.window_first else {}),
        "parts": [
            {
                "phase": part.phase.value,
                "part": part.part,
                "measured_bytes": part.measured_bytes,
                "replayed_bytes": part.replayed_bytes,
                **({"released_late_bytes": part.released_late_bytes} if part.released_late_bytes else {}),
            }
            for part in match.parts
        ],
    }


def strategy_to_dict(strategy: StrategyBuffers | None) -> dict[str, Any] | None:
    """What the strategy holds beyond the replayed step: its label, each buffer's bytes, their sum, the basis."""
    if strategy is None:
        return None
    return {
        "label": strategy.label,
        "bytes": strategy.total_bytes,
        "buffers": list(strategy.buffers),
        "basis": strategy.basis,
    }


def _strategy(fields: Reader, key: str) -> StrategyBuffers | None:
    child = fields.optional_child(key)
    if child is None:
        return None
    child.integer("bytes")  # derived from the buffers
    buffers = child.each("buffers", lambda value, at: as_int(value, at, 0))
    return StrategyBuffers(child.text("label"), tuple(buffers), child.text("basis"))


def sharding_to_dict(trial: ShardingTrial | None) -> dict[str, Any] | None:
    """The simulation's ``sharding``: this rank under its strategy and the next stronger one, with the saving."""
    if trial is None:
        return None
    return {
        "current": trial.current,
        "target": trial.target,
        "target_sharding": trial.target_sharding,
        "world_size": trial.world_size,
        "offload": trial.offload,
        "current_peak_bytes": trial.current_peak_bytes,
        "measured_peak_bytes": trial.measured_peak_bytes,
        "current_phase": trial.current_phase.value,
        "target_peak_bytes": trial.target_peak_bytes,
        "target_phase": trial.target_phase.value,
        "saving_bytes": trial.saving_bytes,
        "current_communication_bytes": trial.current_communication_bytes,
        "target_communication_bytes": trial.target_communication_bytes,
        "target_host_bytes": trial.target_host_bytes,
        "reduce_bucket_size": trial.reduce_bucket_size,
        "allgather_bucket_size": trial.allgather_bucket_size,
        "small_parameter_bytes": trial.small_parameter_bytes,
        "method": trial.method,
    }


def _sharding(fields: Reader, key: str) -> ShardingTrial | None:
    child = fields.optional_child(key)
    if child is None:
        return None
    child.integer("saving_bytes", minimum=None)  # derived from the peaks
    return ShardingTrial(
        current=child.text("current"),
        target=child.text("target"),
        target_sharding=child.optional_text("target_sharding"),
        world_size=child.integer("world_size", minimum=1),
        offload=child.flag("offload"),
        current_peak_bytes=child.integer("current_peak_bytes"),
        measured_peak_bytes=child.optional_integer("measured_peak_bytes"),
        current_phase=phase_from_text(child.text("current_phase"), f"{key}.current_phase"),
        target_peak_bytes=child.integer("target_peak_bytes"),
        target_phase=phase_from_text(child.text("target_phase"), f"{key}.target_phase"),
        current_communication_bytes=child.integer("current_communication_bytes"),
        target_communication_bytes=child.integer("target_communication_bytes"),
        target_host_bytes=child.integer("target_host_bytes"),
        reduce_bucket_size=child.optional_integer("reduce_bucket_size"),
        allgather_bucket_size=child.optional_integer("allgather_bucket_size"),
        small_parameter_bytes=child.integer("small_parameter_bytes"),
        method=child.text("method"),
    )


def offload_to_dict(trial: OffloadTrial | None) -> dict[str, Any] | None:
    """The simulation's ``offload``: this rank as it is and predicted with CPU offload, with the saving."""
    if trial is None:
        return None
    return {
        "strategy": trial.strategy,
        "sharding": trial.sharding,
        "world_size": trial.world_size,
        "current_peak_bytes": trial.current_peak_bytes,
        "measured_peak_bytes": trial.measured_peak_bytes,
        "target_peak_bytes": trial.target_peak_bytes,
        "target_phase": trial.target_phase.value,
        "saving_bytes": trial.saving_bytes,
        "host_bytes": trial.host_bytes,
        "transfer_bytes": trial.transfer_bytes,
        "reduce_bucket_size": trial.reduce_bucket_size,
        "allgather_bucket_size": trial.allgather_bucket_size,
        "small_parameter_bytes": trial.small_parameter_bytes,
        "method": trial.method,
    }


def _offload(fields: Reader, key: str) -> OffloadTrial | None:
    child = fields.optional_child(key)
    if child is None:
        return None
    child.integer("saving_bytes", minimum=None)  # derived from the peaks
    return OffloadTrial(
        strategy=child.text("strategy"),
        sharding=child.optional_text("sharding"),
        world_size=child.integer("world_size", minimum=1),
        current_peak_bytes=child.integer("current_peak_bytes"),
        measured_peak_bytes=child.optional_integer("measured_peak_bytes"),
        target_peak_bytes=child.integer("target_peak_bytes"),
        target_phase=phase_from_text(child.text("target_phase"), f"{key}.target_phase"),
        host_bytes=child.integer("host_bytes"),
        transfer_bytes=child.integer("transfer_bytes"),
        reduce_bucket_size=child.optional_integer("reduce_bucket_size"),
        allgather_bucket_size=child.optional_integer("allgather_bucket_size"),
        small_parameter_bytes=child.added("small_parameter_bytes", Reader.integer, 0),
        method=child.text("method"),
    )


def calibration_to_dict(calibration: Calibration | None) -> dict[str, Any] | None:
    """The simulation's ``calibration``: the sampled step's allocator peaks beside the replay's, per phase."""
    if calibration is None:
        return None
    return {
        "step": calibration.step,
        "phases": [
            {
                "phase": phase.phase.value,
                "replayed_allocated_bytes": phase.replayed_allocated_bytes,
                "measured_allocated_bytes": phase.measured_allocated_bytes,
                "replayed_reserved_bytes": phase.replayed_reserved_bytes,
                "measured_reserved_bytes": phase.measured_reserved_bytes,
                "unseen_bytes": phase.unseen_bytes,
                "unseen_reserved_bytes": phase.unseen_reserved_bytes,
            }
            for phase in calibration.phases
        ],
    }


def _phase_calibration(data: Any, where: str) -> PhaseCalibration:
    fields = Reader(data, where)
    fields.integer("unseen_bytes")  # derived
    fields.integer("unseen_reserved_bytes")  # derived
    return PhaseCalibration(
        phase=phase_from_text(fields.text("phase"), f"{where}.phase"),
        replayed_allocated_bytes=fields.integer("replayed_allocated_bytes"),
        measured_allocated_bytes=fields.integer("measured_allocated_bytes"),
        replayed_reserved_bytes=fields.optional_integer("replayed_reserved_bytes"),
        measured_reserved_bytes=fields.optional_integer("measured_reserved_bytes"),
    )


def _calibration(fields: Reader, key: str) -> Calibration | None:
    child = fields.optional_child(key)
    if child is None:
        return None
    return Calibration(child.integer("step"), tuple(child.each("phases", _phase_calibration)))


def _phase_bytes(fields: Reader, key: str) -> dict[Phase, int] | None:
    child = fields.optional_child(key)
    if child is None:
        return None
    where = member("simulation", key)
    return {phase_from_text(name, where): child.integer(name) for name, _ in fields.entries(key)}


def simulation_to_dict(
    simulation: Simulation | None, advice: tuple[Advice, ...] | None = None
) -> dict[str, Any] | None:
    """The report's ``simulation`` section: the replayed baseline, its match, and each change tried.

    With the report's ``advice``, also the memory op by op (``timeline``) of the baseline and of the change behind
    the first simulated advice (:func:`~lightning_vram.records.simulation.advised_variant`), the two the report
    draws; without (checkpoint state), no timeline.
    """
    if simulation is None:
        return None
    baseline = simulation.baseline
    advised = advised_variant(simulation, advice) if advice is not None else None
    timelines = {"timeline": timeline_to_dict(baseline.timeline if baseline else None)} if advice is not None else {}
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
        "fit_note": simulation.fit_note,
        "calibration": calibration_to_dict(simulation.calibration),
        "strategy": strategy_to_dict(baseline.strategy if baseline is not None else None),
        "allocator_conf": simulation.allocator_conf,
        "expandable_reserved_bytes": (
            None
            if simulation.expandable_reserved_bytes is None
            else {
                phase.value: simulation.expandable_reserved_bytes[phase]
                for phase in Phase
                if phase in simulation.expandable_reserved_bytes
            }
        ),
        **(
            {"accumulate_grad_batches": simulation.accumulate_grad_batches}
            if simulation.accumulate_grad_batches > 1
            else {}
        ),
        "variants": [variant_to_dict(variant, variant is advised) for variant in simulation.variants],
        **({"sharding": sharding_to_dict(simulation.sharding)} if simulation.sharding is not None else {}),
        **({"offload": offload_to_dict(simulation.offload)} if simulation.offload is not None else {}),
        **({"strategy_name": simulation.strategy_name} if simulation.strategy_name is not None else {}),
        **timelines,
    }


def _change(kind: ChangeKind, parameters: Reader) -> StepChange:
    """The change of ``kind`` that :func:`change_parameters` described."""
    if kind == ChangeKind.PRECISION:
        return PrecisionChange(parameters.text("precision"))
    if kind == ChangeKind.CHECKPOINT:
        units = parameters.each("units", lambda unit, at: tuple(text_list(unit, at)))
        plan = CheckpointPlan(
            container=parameters.text("container"),
            units=tuple(units),
            sequential_segments=parameters.optional_integer("sequential_segments", minimum=1),
            saving_bytes=parameters.integer("modelled_saving_bytes", minimum=None),
            forward_of=parameters.optional_text("forward_of"),
            switch=parameters.added("switch", Reader.optional_text, None),
            selective=tuple(parameters.added("selective", Reader.texts, [])),
            shared=tuple(parameters.added("shared", Reader.texts, [])),
        )
        return CheckpointChange(plan)
    if kind == ChangeKind.INPLACE:
        return InplaceChange(tuple(parameters.texts("modules")))
    if kind == ChangeKind.FREE_GRADIENTS:
        return FreeGradientsChange()
    if kind == ChangeKind.LENGTH:
        return LengthChange(parameters.integer("length", minimum=1))
    if kind == ChangeKind.TOKENS_PER_BATCH:
        return TokensPerBatchChange(parameters.integer("tokens", minimum=1))
    return BatchSizeChange(parameters.integer("batch_size", minimum=1))


def _replayed_phases(fields: Reader, key: str, step: int) -> dict[Phase, PhasePeak]:
    phases = {}
    for name, value in fields.entries(key):
        where = member(key, name)
        phase = phase_from_text(name, key)
        peak = Reader(value, where)
        breakdown = breakdown_from_dict(peak.raw("breakdown"), f"{where}.breakdown")
        phases[phase] = PhasePeak(step, phase, peak.integer("peak_bytes"), None, breakdown)
    return phases


def _part_match(data: Any, where: str) -> PartMatch:
    fields = Reader(data, where)
    part = fields.text("part")
    if part not in MATCHED_PARTS:
        raise FormatError(f"{where}.part must be one of {list(MATCHED_PARTS)}, got {shown(part)}")
    return PartMatch(
        phase_from_text(fields.text("phase"), f"{where}.phase"),
        part,
        fields.integer("measured_bytes"),
        fields.integer("replayed_bytes"),
        fields.added("released_late_bytes", Reader.integer, 0),
    )


def _baseline_match(fields: Reader | None) -> BaselineMatch | None:
    if fields is None:
        return None
    fields.flag("matches")  # derived from the parts; checked for its type only
    return BaselineMatch(
        step=fields.integer("step"),
        parts=tuple(fields.each("parts", _part_match)),
        tolerance=fields.number("tolerance"),
        window_first=fields.added("window_first", Reader.flag, False),
    )


def _variant(data: Any, where: str, baseline: ReplayedStep) -> VariantResult:
    """One change tried; its replayed step takes what the JSON leaves out (precision, batch) from ``baseline``."""
    fields = Reader(data, where)
    fields.text("change")  # the change's label, derived from it
    change = _change(member_of(ChangeKind, fields.text("kind"), f"{where}.kind"), fields.child("parameters"))
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
        timeline=fields.added("timeline", timeline_from_dict, None),
        window_first=_replayed_phases(fields, "window_first", step) if fields.has("window_first") else None,
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
            timeline=fields.added("timeline", timeline_from_dict, None),
            strategy=fields.added("strategy", _strategy, None),
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
        fit_note=fields.added("fit_note", Reader.optional_text, None),
        calibration=fields.added("calibration", _calibration, None),
        allocator_conf=fields.added("allocator_conf", Reader.optional_text, None),
        expandable_reserved_bytes=fields.added("expandable_reserved_bytes", _phase_bytes, None),
        accumulate_grad_batches=fields.added("accumulate_grad_batches", _accumulation, 1),
        sharding=fields.added("sharding", _sharding, None),
        offload=fields.added("offload", _offload, None),
        strategy_name=fields.added("strategy_name", Reader.optional_text, None),
    )


def _accumulation(fields: Reader, key: str) -> int:
    return fields.integer(key, minimum=1)


def _phase_or_none(text: str | None, where: str) -> Phase | None:
    return None if text is None else phase_from_text(text, where)
