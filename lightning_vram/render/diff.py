"""What changed from one run's report to another's, as plain text: ``lightning-vram diff A B``.

The peak and each of its parts (or, where the peak moved to another phase, each phase compared with itself), the
run's settings as the reports record them (a setting a report does not record is said to be "not recorded"), the
advice added, removed and changed (not compared where a run measured no step: it stopped first), and where run B
applied one of the changes run A's replay simulated (a precision, a batch size, a length cap, or a checkpointing
plan, which B's recomputed units show, each re-run whole or under torch's selective checkpointing as the plan says),
the peak A's replay predicted for it beside the peak B measured,
and the step-time cost A's advice predicted for it beside the change of B's median step time. Where B checkpointed a
simulated plan's units otherwise (selectively where the plan keeps them whole), it says that A's prediction is of
another plan, with no verdict. A step-time ratio or verdict always comes with how much each run's step times varied
(their interquartile range over their median): above :data:`STEP_TIME_SPREAD_BOUND` in either run (a loaded
machine), the diff says the ratio is not reliable.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_vram.advice.rules.chunked_loss import LOSS_CHUNKS
from lightning_vram.records import (
    CATEGORIES,
    Advice,
    AdviceId,
    BatchSizeChange,
    CheckpointChange,
    CheckpointPlan,
    LengthChange,
    Phase,
    PhasePeak,
    PrecisionChange,
    Report,
    SavingBasis,
    StepChange,
    VariantResult,
    in_phase_order,
)
from lightning_vram.records.advice import layer_ranges
from lightning_vram.render.markup import printable
from lightning_vram.units import format_bytes, format_percent

PHASE_NAMES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.OPTIMIZER: "optimizer step"}
"""Each phase as the diff names it in a sentence."""
NOT_RECORDED = "not recorded"
"""What the diff says of a setting a report does not hold."""
TIME_TOLERANCE_SHARE = 0.25
"""A predicted step-time cost is met where the measured change of the median step time is within this share of it...
"""
TIME_TOLERANCE_SECONDS = 0.001
"""...or within this many seconds of it (a tiny step's cost is below the timer's run-to-run noise)."""
STEP_TIME_SPREAD_BOUND = 0.25
"""A run's median step time is compared only where its recent step times' interquartile range is at most this share
of their median; above it (a machine loaded by other work), a ratio of step times is said to be not reliable."""


def change_text(before: int | None, after: int | None) -> str:
    """Bytes from ``before`` to ``after``, with the difference and its share of ``before``.

    >>> change_text(1024, 1536)
    '1.0 KiB -> 1.5 KiB: +512 B (+50.0%)'
    >>> change_text(None, 1024)
    'n/a -> 1.0 KiB'
    """
    if before is None or after is None:
        return f"{format_bytes(before)} -> {format_bytes(after)}"
    delta = after - before
    sign = "+" if delta >= 0 else "-"
    relative = f" ({sign}{abs(delta) / before:.1%})" if before else ""
    return f"{format_bytes(before)} -> {format_bytes(after)}: {sign}{format_bytes(abs(delta))}{relative}"


def _parts(peak: PhasePeak | None) -> dict[str, int | None]:
    """Each part of ``peak``'s breakdown in bytes, empty where it has none."""
    return dict(peak.breakdown.to_dict()) if peak is not None and peak.breakdown is not None else {}


def _parts_lines(before: PhasePeak | None, after: PhasePeak | None, indent: str) -> list[str]:
    """One line per part, from ``before``'s breakdown to ``after``'s."""
    parts_before, parts_after = _parts(before), _parts(after)
    return [
        f"{indent}{name.replace('_', ' ')}: {change_text(parts_before.get(name), parts_after.get(name))}"
        for name in CATEGORIES
    ]


def _peak_bytes(report: Report) -> int | None:
    """The run's highest peak in bytes (``None``: not measured)."""
    return report.peak.peak_bytes if report.peak is not None else None


def peak_lines(before: Report, after: Report) -> list[str]:
    """The peak, its phase and parts, and each phase's peak.

    Where the peak moved to another phase, the two peaks' parts are not like with like (a part can be absent from
    one phase without being freed): the lines say where the peak moved and compare each phase with itself.
    """
    lines = [f"peak: {change_text(_peak_bytes(before), _peak_bytes(after))}"]
    moved = before.peak is not None and after.peak is not None and before.peak.phase is not after.peak.phase
    if moved and before.peak is not None and after.peak is not None:
        lines.append(
            f"  the peak moved from {PHASE_NAMES[before.peak.phase]} to {PHASE_NAMES[after.peak.phase]}: each"
            " phase is compared with itself below, part by part"
        )
    else:
        if before.peak is not None and after.peak is not None:
            lines.append(f"  in {PHASE_NAMES[after.peak.phase]} in both runs")
        lines += _parts_lines(before.peak, after.peak, "  ")
    phases_after = dict(in_phase_order(after.phases))
    for phase, peak in in_phase_order(before.phases):
        other = phases_after.get(phase)
        lines.append(f"  {phase.value} peak: {change_text(peak.peak_bytes, other.peak_bytes if other else None)}")
        if moved:
            lines += _parts_lines(peak, other, "    ")
    return lines


def _setting(name: str, before: object, after: object) -> str:
    """One setting's line: its value in both runs, or from ``before`` to ``after``; ``None`` is "not recorded".

    >>> _setting("precision", "32-true", "bf16-mixed"), _setting("batch size", 8, 8), _setting("device", None, None)
    ('  precision: 32-true -> bf16-mixed', '  batch size: 8 in both runs', '  device: not recorded')
    """
    shown_before, shown_after = (NOT_RECORDED if value is None else printable(str(value)) for value in (before, after))
    if shown_before == shown_after:
        return f"  {name}: {shown_before}" + ("" if before is None else " in both runs")
    return f"  {name}: {shown_before} -> {shown_after}"


def _device(report: Report) -> str:
    """The device as the report names it: its type and name, with its memory where measured."""
    device = report.device
    memory = f" ({format_bytes(device.total_bytes)})" if device.total_bytes is not None else ""
    return f"{device.type} {device.name}{memory}"


def _world_size(report: Report) -> int | None:
    """How many processes trained: one summary per rank (``None`` where the report lists none)."""
    return len(report.ranks) or None


def _seconds(before: float | None, after: float | None) -> str:
    """A time per step from ``before`` to ``after``, with their ratio.

    >>> _seconds(0.2, 0.0686), _seconds(None, 0.1)
    ('200.0 ms -> 68.6 ms (0.34x)', 'not recorded -> 100.0 ms')
    """
    shown = [NOT_RECORDED if value is None else f"{value * 1000:.1f} ms" for value in (before, after)]
    ratio = f" ({after / before:.2f}x)" if before and after is not None else ""
    return f"{shown[0]} -> {shown[1]}{ratio}"


def _spread(report: Report) -> float | None:
    """How much the run's recent step times varied: interquartile range over the median (``None``: not recorded)."""
    return report.timing.step_time_iqr_fraction


def noise_text(before: Report, after: Report) -> str:
    """How much each run's step times varied, and whether a ratio of their medians can be trusted.

    Not reliable where either run's interquartile range of step times is above :data:`STEP_TIME_SPREAD_BOUND` of its
    median; unknown where a report does not record it (an older report, or under four steps timed); else steady
    within each run, which cannot tell a machine's load that changed between the two runs (a new user's trial: both
    runs within the bound, a checkpointing cost measured at -51.6 ms for +6.8 ms predicted).
    """
    spreads = {"A": _spread(before), "B": _spread(after)}
    shown = ", ".join(f"{_share(spread)} in {run}" for run, spread in spreads.items())
    measure = f"step times vary (interquartile range over the median) {shown}"
    noisy = _noisy(before, after)
    if noisy:
        runs = " and ".join(noisy)
        return (
            f"{measure}: not reliable, over {format_percent(STEP_TIME_SPREAD_BOUND)} in {runs} (a machine loaded by"
            " other work times steps unevenly; measure again on a quiet one)"
        )
    if None in spreads.values():
        return f"{measure}: reliability unknown"
    return (
        f"{measure}: within {format_percent(STEP_TIME_SPREAD_BOUND)}, steady within each run (a load that changed"
        " between the runs is not seen here)"
    )


def _noisy(before: Report, after: Report) -> list[str]:
    """The runs ("A", "B") whose step times varied more than :data:`STEP_TIME_SPREAD_BOUND` of their median."""
    spreads = {"A": _spread(before), "B": _spread(after)}
    return [run for run, spread in spreads.items() if spread is not None and spread > STEP_TIME_SPREAD_BOUND]


def _step_time_line(before: Report, after: Report) -> str:
    """The median step times and their ratio, never without how much each run's step times varied."""
    seconds = _seconds(before.timing.step_seconds_median, after.timing.step_seconds_median)
    if before.timing.step_seconds_median is None or after.timing.step_seconds_median is None:
        return f"  step time (median): {seconds}"
    return f"  step time (median): {seconds}; {noise_text(before, after)}"


def _share(fraction: float | None) -> str:
    """A share of the step time as a percent, or "not recorded".

    >>> _share(0.034), _share(None)
    ('3.4%', 'not recorded')
    """
    return NOT_RECORDED if fraction is None else format_percent(fraction)


def _recomputed(report: Report) -> str | None:
    """How many units activation checkpointing recomputed in backward on the sampled step (``None``: not recorded).

    Each unit once, however many times it re-ran (a module called twice in forward is recomputed twice, and is one
    unit); with how many of them torch's selective checkpointing re-ran, where any did, and how many recomputations
    there were, where more than units.
    """
    units, selective = report.recomputed_units, report.selective_units
    if units is None:
        return None
    distinct = len(set(units))
    notes = [f"{len(set(selective))} selectively"] if selective else []
    notes += [f"recomputed {len(units)} times in all"] if len(units) > distinct else []
    return f"{distinct} ({'; '.join(notes)})" if notes else str(distinct)


def _strategy(report: Report) -> str | None:
    """The run's strategy where its report names it (``"deepspeed_stage_2"``, ``"fsdp2"``; ``None`` elsewhere).

    The report has no field of its own for the strategy (schema ``lightning_vram.report/1``): a multi-process run's
    replay names the strategy it replayed the rank under (``simulation.strategy_name``: DDP, FSDP2, FSDP1, ZeRO);
    a file written before it did names a sharded run's in its trial of the next stronger sharding or of CPU offload.
    """
    simulation = report.simulation
    if simulation is None:
        return None
    if simulation.strategy_name is not None:
        return simulation.strategy_name
    if simulation.sharding is not None:
        return simulation.sharding.current
    return simulation.offload.strategy if simulation.offload is not None else None


def settings_lines(before: Report, after: Report) -> list[str]:
    """The run's settings and timing, as each report records them.

    The strategy only where either report names it (:func:`_strategy`): a line that would always read "not
    recorded" says nothing.
    """
    strategies = _strategy(before), _strategy(after)
    strategy = [_setting("strategy", *strategies)] if strategies != (None, None) else []
    return [
        "run:",
        _setting("precision", before.precision, after.precision),
        _setting("batch size", before.batch_size, after.batch_size),
        _setting("world size", _world_size(before), _world_size(after)),
        *strategy,
        _setting("device", _device(before), _device(after)),
        _step_time_line(before, after),
        f"  data wait (of step time): {_share(before.timing.data_wait_fraction)} ->"
        f" {_share(after.timing.data_wait_fraction)}",
        _setting("units recomputed in backward (activation checkpointing)", _recomputed(before), _recomputed(after)),
        *_ending_lines(before, after),
    ]


def _ending(report: Report) -> str:
    """How the run ended, as its report says: "finished", or the error it stopped with."""
    return "finished" if report.ended_with is None else f"stopped with {printable(report.ended_with)}"


def _ending_lines(before: Report, after: Report) -> list[str]:
    """How each run ended, where either stopped with an error (none where both finished)."""
    if before.ended_with is None and after.ended_with is None:
        return []
    endings = _ending(before), _ending(after)
    if endings[0] == endings[1]:
        return [f"  run ended: {endings[0]} in both runs"]
    return [f"  run ended: {endings[0]} -> {endings[1]}"]


INTERRUPTED = ("KeyboardInterrupt",)
"""How a report's ``ended_with`` begins where the user stopped the run (Ctrl-C, Lightning's graceful shutdown): no
error of the run's."""


def _stopped_how(ended_with: str) -> str:
    """How a run that did not finish stopped, in words: interrupted by the user, or with an error.

    >>> _stopped_how("KeyboardInterrupt"), _stopped_how("RuntimeError: CUDA out of memory")
    ('was interrupted (KeyboardInterrupt)', 'stopped with an error')
    """
    if ended_with.partition(":")[0] in INTERRUPTED:
        return f"was interrupted ({ended_with})"
    return "stopped with an error"


def _advice_change(before: Advice, after: Advice) -> str | None:
    """How one advice differs between the runs (its title, severity, saving, predicted peak), ``None`` if not."""
    changes = []
    if before.title != after.title:
        changes.append(f'"{printable(before.title)}" -> "{printable(after.title)}"')
    if before.severity is not after.severity:
        changes.append(f"severity {before.severity.value} -> {after.severity.value}")
    if before.estimated_saving_bytes != after.estimated_saving_bytes:
        changes.append(
            f"saving {format_bytes(before.estimated_saving_bytes)} -> {format_bytes(after.estimated_saving_bytes)}"
        )
    if before.predicted_peak_bytes != after.predicted_peak_bytes:
        changes.append(
            f"predicted peak {format_bytes(before.predicted_peak_bytes)} -> {format_bytes(after.predicted_peak_bytes)}"
        )
    return "; ".join(changes) or None


def _unmeasured_advice_line(before: Report, after: Report) -> str | None:
    """Why the advice is not compared, where a run stopped with an error before it measured a training step.

    Its rules had no evidence there, and advice gone is not advice the change fixed. ``None`` where both runs
    measured a step, or where one measured none without an error (compared as before).
    """
    for run, report, other in (("A", before, after), ("B", after, before)):
        if report.peak is not None or report.ended_with is None:
            continue  # a step measured, or no error (an empty run's report, or one written before ended_with)
        stopped = f" (it stopped with {printable(report.ended_with)})"
        other_run = "B" if run == "A" else "A"
        advised = ", ".join(sorted(item.id.value for item in other.advice)) or "nothing"
        return f"advice: not compared: {run} measured no training step{stopped}; {other_run} advised {advised}"
    return None


def advice_lines(before: Report, after: Report) -> list[str]:
    """Advice removed, added and changed (same id, another title, severity, saving or predicted peak).

    Not compared where either run measured no step (:func:`_unmeasured_advice_line`); where a run stopped with an
    error after some steps, the advice it lacks is said to cover only its steps until then.
    """
    unmeasured = _unmeasured_advice_line(before, after)
    if unmeasured is not None:
        return [unmeasured]
    by_id_before = {item.id.value: item for item in before.advice}
    by_id_after = {item.id.value: item for item in after.advice}
    stopped = {
        run: f" ({run} {_stopped_how(report.ended_with)}: its advice covers its steps until then)"
        if report.ended_with is not None
        else ""
        for run, report in (("A", before), ("B", after))
    }
    lines = [
        f"advice removed: {advice_id}{stopped['B']}" for advice_id in sorted(by_id_before.keys() - by_id_after.keys())
    ]
    lines += [
        f"advice added: {advice_id}{stopped['A']}" for advice_id in sorted(by_id_after.keys() - by_id_before.keys())
    ]
    for advice_id in sorted(by_id_before.keys() & by_id_after.keys()):
        change = _advice_change(by_id_before[advice_id], by_id_after[advice_id])
        if change is not None:
            lines.append(f"advice changed: {advice_id}: {change}")
    return lines or ["advice: unchanged"]


def _longest_length(report: Report) -> int | None:
    """The longest batch (tokens along its length) the run saw, where the report counts lengths."""
    counts = report.shapes.length_counts if report.shapes is not None else ()
    return max((length for length, _ in counts), default=None)


def _within(name: str, modules: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``modules`` or inside one (a ``Checkpointed`` wrapper's ``.block``).

    >>> _within("net.1.block", ("net.1",)), _within("net.10", ("net.1",))
    (True, False)
    """
    return any(name == module or name.startswith(f"{module}.") for module in modules)


def _reruns(recomputed: tuple[str, ...], unit: tuple[str, ...]) -> bool:
    """Whether a recomputation that re-ran ``recomputed`` (outermost modules, in order) is ``unit``'s.

    It starts at the unit's first module and re-runs nothing outside the unit (it may stop short of the unit's
    last modules: torch stops a recomputation once it has what backward needs).
    """
    return bool(recomputed) and _within(recomputed[0], unit[:1]) and all(_within(name, unit) for name in recomputed)


def _added(before: Report, after: Report) -> list[tuple[str, ...]]:
    """The units run ``after`` recomputed in backward and run ``before`` did not, each once, in ``after``'s order.

    A module called more than once in forward (one pooling layer after every stage) is recomputed once per call, and
    is still one unit.
    """
    already = set(before.recomputed_units or ())
    return [unit for unit in dict.fromkeys(after.recomputed_units or ()) if unit not in already]


def _chunked_head(before: Report, after: Report) -> tuple[str, ...] | None:
    """The output layer run ``after`` recomputed once per chunk of A's chunked-loss advice (``None``: none).

    The advice's printed function recomputes the output layer (its ``head``, called directly, no checkpointing
    wrapper) once per chunk in backward, :data:`~lightning_vram.advice.rules.chunked_loss.LOSS_CHUNKS` chunks as
    printed, so run ``after`` records it as one unit recomputed that many times. The advice names no module, so that
    count is what tells the output layer from a checkpointed module called more than once in forward (a shared
    dropout or pooling layer, recomputed once per call): a unit recomputed another number of times is not taken for
    it, nor is any where ``before`` did not advise chunked-loss.
    """
    if not any(item.id is AdviceId.CHUNKED_LOSS for item in before.advice):
        return None
    recomputed = list(after.recomputed_units or ())
    chunked = [unit for unit in _added(before, after) if recomputed.count(unit) == LOSS_CHUNKS]
    return chunked[0] if len(chunked) == 1 else None


def _selectively_rerun(
    plan: CheckpointPlan, before: Report, after: Report, beside_chunks: bool = False
) -> frozenset[str] | None:
    """The units of ``plan`` (by their first module) run ``after`` re-ran selectively; ``None``: not ``plan``'s units.

    Run ``after`` recomputed ``plan``'s units where it recomputed exactly those in backward, besides what ``before``
    recomputed (:func:`_added`, each unit once however many times it was called): one recomputation per unit, each
    the unit's own (a ``Checkpointed`` wrapper, a segment of ``checkpoint_sequential``, a layer under a library's
    switch); ``None`` where ``after`` did not record them. A
    report that does not record which units re-ran selectively (written before it did) is taken to have re-run
    ``plan``'s. Where run ``after`` also computed its loss in chunks (:func:`_chunked_head`), ``plan``'s prediction
    is not of that step: ``None``, unless asked for ``plan``'s units ``beside_chunks`` (then ``None`` without them).
    """
    if after.recomputed_units is None:
        return None
    head = _chunked_head(before, after)
    if (head is not None) != beside_chunks:
        return None
    added = [unit for unit in _added(before, after) if unit != head]
    reruns = [next((rerun for rerun in added if _reruns(rerun, unit)), None) for unit in plan.units]
    if len(added) != len(plan.units) or any(rerun is None for rerun in reruns):
        return None
    if after.selective_units is None:
        return frozenset(plan.selective)
    return frozenset(
        unit[0] for unit, rerun in zip(plan.units, reruns, strict=True) if rerun and rerun[0] in after.selective_units
    )


def _checkpointed(plan: CheckpointPlan, before: Report, after: Report) -> bool:
    """Whether run ``after`` recomputed exactly ``plan``'s units in backward, each selectively where ``plan`` says.

    :func:`_selectively_rerun`: a unit ``plan`` checkpoints whole re-ran whole, a selective one selectively.
    """
    return _selectively_rerun(plan, before, after) == frozenset(plan.selective)


def _applied(change: StepChange, before: Report, after: Report) -> bool:
    """Whether run ``after`` is run ``before`` with ``change`` applied, as far as the reports can tell.

    Decided for a precision, a batch size and a length cap, each with the other two settings alike in both runs, and
    for a checkpointing plan (what run ``after`` recomputed in backward, whole or selectively), with the precision
    and batch size alike;
    a change the reports hold no evidence of (inplace activations, freed gradients, batching by tokens) is never
    said to be applied.
    """
    same_precision = before.precision is not None and before.precision == after.precision
    same_batch = before.batch_size is not None and before.batch_size == after.batch_size
    if isinstance(change, PrecisionChange):
        return same_batch and after.precision == change.precision
    if isinstance(change, BatchSizeChange):
        return same_precision and after.batch_size == change.batch_size
    if isinstance(change, LengthChange):
        longest_before, longest_after = _longest_length(before), _longest_length(after)
        return (
            same_precision
            and same_batch
            and longest_before is not None
            and longest_before > change.length
            and longest_after == change.length
        )
    if isinstance(change, CheckpointChange):
        return same_precision and same_batch and _checkpointed(change.plan, before, after)
    return False


def _predicted_bytes(variant: VariantResult) -> int | None:
    """The peak the variant's replay predicts, as the report measures peaks (``None``: it was discarded)."""
    replayed = variant.replayed
    return replayed.reported_bytes(replayed.reported_peak) if replayed is not None and replayed.phases else None


def _cost_of(predicted: int, before: Report) -> Advice | None:
    """The advice of ``before`` whose predicted peak is ``predicted`` bytes, where it has a time cost."""
    return next(
        (
            item
            for item in before.advice
            if item.predicted_peak_bytes == predicted and item.cost_basis is not None and item.flop_ratio is not None
        ),
        None,
    )


def _milliseconds(seconds: float) -> str:
    """Seconds as signed milliseconds.

    >>> _milliseconds(0.01234), _milliseconds(-0.0005)
    ('+12.3 ms', '-0.5 ms')
    """
    return f"{1000 * seconds:+.1f} ms"


def time_line(advice: Advice, before: Report, after: Report) -> str:
    """The step-time cost ``advice`` predicted beside the change of the median step time from run A to run B.

    The prediction is met where the measured change is within :data:`TIME_TOLERANCE_SHARE` of it or within
    :data:`TIME_TOLERANCE_SECONDS`; a cost not modelled from FLOPs (another precision) is shown without a verdict, and
    so is any cost where a run's step times are not reliable (:func:`noise_text`): a loaded machine's.
    Where both medians are measured, the line ends with how much each run's step times varied (:func:`noise_text`).
    """
    median_before, median_after = before.timing.step_seconds_median, after.timing.step_seconds_median
    label = advice.id.value
    measured = (
        f"B's median step took {_milliseconds(median_after - median_before)}"
        f" ({median_before * 1000:.1f} ms -> {median_after * 1000:.1f} ms)"
        if median_before is not None and median_after is not None
        else f"step time {NOT_RECORDED}"
    )
    predicted = advice.estimated_cost_seconds
    verdict = ""
    if predicted is not None and median_before is not None and median_after is not None:
        tolerance = max(TIME_TOLERANCE_SHARE * abs(predicted), TIME_TOLERANCE_SECONDS)
        within = abs(median_after - median_before - predicted) <= tolerance
        judged = (
            "no verdict, the step times are not reliable"
            if _noisy(before, after)
            else f"{'within' if within else 'outside'} the tolerance of {format_percent(TIME_TOLERANCE_SHARE)}"
            f" or {1000 * TIME_TOLERANCE_SECONDS:.0f} ms"
        )
        verdict = (
            f"; the cost measured {_milliseconds(median_after - median_before)} for {_milliseconds(predicted)}"
            f" predicted: {judged}"
        )
    if advice.predicted_step_seconds is not None and median_after is not None:
        verdict += f"; predicted step with the change {advice.predicted_step_seconds * 1000:.1f} ms"
    noise = f"; {noise_text(before, after)}" if median_before is not None and median_after is not None else ""
    if predicted is None:
        return f"step time ({label}): A's advice said {advice.cost_text}; {measured}{verdict}{noise}"
    flops = f"{advice.flop_ratio - 1:+.1%} FLOPs, {advice.cost_basis}" if advice.flop_ratio is not None else ""
    return (
        f"step time ({label}): A's replay predicted {_milliseconds(predicted)} a step ({flops}), {measured}{verdict}"
        f"{noise}"
    )


def _applied_variants(before: Report, after: Report) -> list[tuple[VariantResult, int]]:
    """Each change ``before``'s replay simulated that run ``after`` applied, with the peak it predicted (bytes)."""
    if _peak_bytes(after) is None or before.device.type != after.device.type:
        return []
    variants = before.simulation.variants if before.simulation is not None else ()
    return [
        (variant, predicted)
        for variant in variants
        if (predicted := _predicted_bytes(variant)) is not None and _applied(variant.change, before, after)
    ]


def _first_micro_batch(report: Report) -> int | None:
    """The step whose peak the report's is, where that step is an accumulation window's first micro-batch.

    A report's peak is its sampled step's where only sampled steps are measured (the CPU's live peaks); under
    gradient accumulation that step may be a window's first micro-batch (no gradients held before backward, no
    optimizer step), which holds less than the steady one the replay's figures are of. ``None`` elsewhere.
    """
    match = report.simulation.match if report.simulation is not None else None
    if match is None or not match.window_first or report.peak is None or report.peak.step != match.step:
        return None
    return match.step


def _first_predicted(variant: VariantResult) -> int | None:
    """The peak the variant's replay predicts for an accumulation window's first micro-batch (``None``: not kept).

    As the report measures peaks; kept in reports written since variants record it (a variant's ``window_first``).
    """
    replayed = variant.replayed
    if replayed is None or not replayed.window_first:
        return None
    return max(replayed.reported_bytes(phase) for phase in replayed.window_first.values())


def _steady(report: Report) -> str:
    """Which step the report's replayed figures are of: a window's steady micro-batch, or a step not accumulating."""
    window = report.simulation.accumulate_grad_batches if report.simulation is not None else 1
    if window > 1:
        return "on an accumulation window's steady micro-batch (a later one, with the optimizer step)"
    return "on a step without gradient accumulation"


def _difference(measured: int | None, predicted: int) -> str:
    """``(measured - predicted) / predicted`` as a signed percent ("n/a" where either is unknown or 0)."""
    return f"{(measured - predicted) / predicted:+.1%}" if predicted and measured is not None else "n/a"


def prediction_lines(before: Report, after: Report) -> list[str]:
    """For each change ``before``'s replay simulated that run ``after`` applied: the predicted and measured peaks.

    The difference is ``(measured - predicted) / predicted``. Like with like under gradient accumulation: the
    replay's peak is the steady micro-batch's (a later one of the window, with the optimizer step); where B's peak
    is of a window's first micro-batch (:func:`_first_micro_batch`), it is set against A's replay of a first
    micro-batch (:func:`_first_predicted`), and where A's report does not hold one (written before it did), it
    says that the micro-batches differ, with no verdict. Where B stopped with an error (an out-of-memory error among
    them), its peak is of the steps before it stopped, not of the step that failed: no verdict either (a run that
    ran out of memory read "diff +0.0%" against A's prediction).
    """
    measured = _peak_bytes(after)
    first_step = _first_micro_batch(after)
    lines = []
    for variant, predicted in _applied_variants(before, after):
        label = printable(variant.change.label)
        first = _first_predicted(variant)
        if after.ended_with is not None:
            lines.append(
                f"A's replay predicted {format_bytes(predicted)} for {label}, B measured {format_bytes(measured)}"
                f" on its steps before it stopped with {printable(after.ended_with)}: not its whole run, no verdict"
            )
        elif first_step is None:
            lines.append(
                f"A's replay predicted {format_bytes(predicted)} for {label}, B measured {format_bytes(measured)}"
                f" (diff {_difference(measured, predicted)})"
            )
        elif first is not None:
            lines.append(
                f"A's replay predicted {format_bytes(first)} for {label} on an accumulation window's first"
                f" micro-batch ({format_bytes(predicted)} on the steady one, with the optimizer step), B measured"
                f" {format_bytes(measured)} on its first micro-batch (sampled step {first_step})"
                f" (diff {_difference(measured, first)})"
            )
        else:
            lines.append(
                f"A's replay predicted {format_bytes(predicted)} for {label} {_steady(before)}, B measured"
                f" {format_bytes(measured)} on its first micro-batch (sampled step {first_step}): not the same"
                " micro-batch, no verdict"
            )
    return lines


def _how(selective: frozenset[str], plan: CheckpointPlan) -> str:
    """Which of ``plan``'s units are checkpointed selectively (``selective``, by first module), in a few words.

    >>> plan = CheckpointPlan("h", (("h.0",), ("h.1",), ("h.2",)), None, 0)
    >>> _how(frozenset(), plan), _how(frozenset({"h.0", "h.1", "h.2"}), plan), _how(frozenset({"h.1", "h.2"}), plan)
    ('every unit whole', 'every unit selectively', 'h.1-2 selectively, the others whole')
    """
    if len(plan.units) == 1:
        return "selectively" if selective else "whole"
    if not selective:
        return "every unit whole"
    if len(selective) == len(plan.units):
        return "every unit selectively"
    kept = layer_ranges(tuple(unit[0] for unit in plan.units if unit[0] in selective))
    return f"{kept} selectively, the others whole"


def other_plan_lines(before: Report, after: Report) -> list[str]:
    """Where run ``after`` checkpointed a simulated plan's units otherwise (selectively, not whole): no verdict.

    Where it checkpointed units no simulated plan has, it says that no prediction covers them
    (:func:`_unsimulated_lines`).

    That is where ``after`` recomputed the units of a plan ``before``'s replay simulated, selectively where that plan
    checkpoints them whole (or the other way), and applied no plan ``before`` simulated: the prediction is of another
    plan. Selective checkpointing keeps what its policy saves (matrix products' outputs), so its peak is above the whole
    plan's: the whole plan's prediction is no test of it.
    """
    measured = _peak_bytes(after)
    if measured is None or before.device.type != after.device.type:
        return []
    if before.simulation is None or before.simulation.skipped is not None:
        return _unreplayed_lines(before, after, measured)
    if any(isinstance(variant.change, CheckpointChange) for variant, _ in _applied_variants(before, after)):
        return []
    same_settings = before.precision == after.precision and before.batch_size == after.batch_size
    lines = []
    for variant in before.simulation.variants:
        change, predicted = variant.change, _predicted_bytes(variant)
        if not same_settings or not isinstance(change, CheckpointChange) or predicted is None:
            continue
        rerun = _selectively_rerun(change.plan, before, after)
        if rerun is not None and rerun != frozenset(change.plan.selective):
            lines.append(
                f"A's replay predicted {format_bytes(predicted)} for {printable(change.label)},"
                f" {_how(frozenset(change.plan.selective), change.plan)}; B checkpointed"
                f" {_how(rerun, change.plan)}: another plan, no verdict (B measured {format_bytes(measured)})"
            )
    return lines or _unsimulated_lines(before, after, measured)


def _unsimulated_lines(before: Report, after: Report, measured: int) -> list[str]:
    """Where run ``after`` recomputed units ``before`` did not, by no plan ``before``'s replay simulated: say so.

    Without it the diff is silent on the change a user made (a plan from ``predict(memory_budget=...)``, units of
    several containers), and the only predicted figure left in sight is an advice's, easily taken for this one's.
    """
    added = _added(before, after)
    plans = (
        [variant.change.plan for variant in before.simulation.variants if isinstance(variant.change, CheckpointChange)]
        if before.simulation is not None
        else []
    )
    if not added or any(_selectively_rerun(plan, before, after) is not None for plan in plans):
        return []
    lines, chunks = _chunked_loss_lines(before, after, measured)
    rest = [unit for unit in added if unit not in chunks]
    beside = (
        [
            (variant.change, predicted)
            for variant in before.simulation.variants
            if isinstance(variant.change, CheckpointChange)
            and (predicted := _predicted_bytes(variant)) is not None
            and _selectively_rerun(variant.change.plan, before, after, beside_chunks=True)
            == frozenset(variant.change.plan.selective)
        ]
        if before.simulation is not None
        else []
    )
    if rest and beside:
        change, predicted = beside[0]
        lines.append(
            f"B recomputed {len(rest)} unit(s) in backward as A's {printable(change.label)} does, beside the chunked"
            f" loss: A's replay predicted {format_bytes(predicted)} for that plan alone, none for both together: no"
            f" verdict (B measured {format_bytes(measured)})"
        )
    elif rest:
        lines.append(
            f"B recomputed {len(rest)} unit(s) in backward that no checkpointing plan A's replay simulated: no"
            f" prediction to check (B measured {format_bytes(measured)})"
        )
    return lines


def _chunked_loss_lines(before: Report, after: Report, measured: int) -> tuple[list[str], list[tuple[str, ...]]]:
    """Where ``before`` advised chunked-loss and run ``after`` recomputed the output layer once per chunk: say so.

    That output layer is :func:`_chunked_head`. The advice's saving was modelled (no replay applies it): set beside
    how far the peak fell. Returns the lines and the units they account for.
    """
    promised = next((item.estimated_saving_bytes for item in before.advice if item.id is AdviceId.CHUNKED_LOSS), None)
    unit = _chunked_head(before, after)
    before_peak = _peak_bytes(before)
    if promised is None or unit is None or before_peak is None:
        return [], []
    fell = before_peak - measured
    outcome = (
        f"the peak fell {format_bytes(fell)} ({format_percent(fell / promised)} of it)"
        if fell > 0
        else f"the peak did not fall (B's is {format_bytes(-fell)} above A's)"
    )
    line = (
        f"B recomputed {', '.join(unit)} {LOSS_CHUNKS} times in backward: A's {AdviceId.CHUNKED_LOSS.value} advice"
        f" applied ({LOSS_CHUNKS} chunks); it promised about {format_bytes(promised)} (modelled), {outcome}"
        f" (B measured {format_bytes(measured)})"
    )
    return [line], [unit]


def _unreplayed_lines(before: Report, after: Report, measured: int) -> list[str]:
    """Where run ``after`` recomputed units ``before`` did not, and ``before``'s step was not replayed: say so.

    Beside it, ``before``'s modelled checkpointing promise and how far the peak fell. A new user's trial applied a
    modelled advice ("about 62.0 MiB (modelled)"), saved 47.5 MiB, and read "no checkpointing plan A's replay
    simulated", of a run whose step was never replayed.
    """
    added = _added(before, after)
    if not added:
        return []
    why = before.simulation.skipped if before.simulation is not None else "no replay in its report"
    line = (
        f"B recomputed {len(added)} unit(s) in backward; A's step was not replayed ({why}): no simulated prediction"
        f" to check (B measured {format_bytes(measured)})"
    )
    promised = next(
        (
            item.estimated_saving_bytes
            for item in before.advice
            if item.id is AdviceId.ACTIVATION_CHECKPOINTING and item.saving_basis is SavingBasis.MODELLED
        ),
        None,
    )
    before_peak = _peak_bytes(before)
    if promised and before_peak is not None:
        fell = before_peak - measured
        outcome = (
            f"the peak fell {format_bytes(fell)} ({format_percent(fell / promised)} of it)"
            if fell > 0
            else f"the peak did not fall (B's is {format_bytes(-fell)} above A's)"
        )
        advice = AdviceId.ACTIVATION_CHECKPOINTING.value
        line += f"; A's modelled {advice} advice promised about {format_bytes(promised)}, {outcome}"
    return [line]


def time_lines(before: Report, after: Report) -> list[str]:
    """Where run ``after`` applied a change ``before`` advised with a step-time cost: that cost and the measured one.

    One line per change (:func:`time_line`): the cost A's advice predicted beside the change of the median step time.
    """
    found = [_cost_of(predicted, before) for _, predicted in _applied_variants(before, after)]
    return [time_line(advice, before, after) for advice in found if advice is not None]


SECTIONS: tuple[Callable[[Report, Report], list[str]], ...] = (
    peak_lines,
    settings_lines,
    advice_lines,
    prediction_lines,
    other_plan_lines,
    time_lines,
)
"""The diff's sections, in order."""


def diff_text(before: Report, after: Report) -> str:
    """What changed from run ``before`` (A) to run ``after`` (B): each of :data:`SECTIONS`, one line per fact."""
    return "\n".join(line for section in SECTIONS for line in section(before, after))
