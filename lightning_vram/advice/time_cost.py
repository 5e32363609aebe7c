"""What an advised change costs in step time, from the FLOPs its replay counted beside the baseline's.

Each replay of the simulation counts its step's floating-point operations (``ReplayedStep.flops``, torch's
``FlopCounterMode`` over the fake step: matrix products, convolutions, attention). An advice whose change was
replayed gets the ratio of its replay's FLOPs to the baseline's, and, where the work stays the same and only its
amount changes, a time cost (checkpointing's recomputed forward): the predicted step time below less the run's
measured median, where the step's ops could be priced, else the median times ``ratio - 1``. Where the FLOPs are the
same, the cost is 0 and the advice says so; where the change alters what is computed in another way (another
precision, fewer tokens a step), the ratio is given and the time is not modelled from it.

Beside the cost, each replayed change's step time is predicted (``Advice.predicted_step_seconds``): both replays'
ops priced on the run's device by a roofline per op (:mod:`lightning_vram.prediction.timing`; the CPU measured once
per process, a GPU by its published peaks), the baseline's prediction calibrated to the run's measured median step
time and the factor carried to the change's. Unlike the FLOP ratio it prices every op, memory-bound ones too: a
change of precision or of tokens a step gets a predicted time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_vram.advice.budget import recomputation_seconds
from lightning_vram.advice.checkpointing import recomputed_modules
from lightning_vram.advice.cost_ties import Work, counted_work, least_alike
from lightning_vram.prediction.timing import DevicePeaks, calibrated, gpu_peaks, measure_host_peaks, predict_step_time
from lightning_vram.prediction.timing.checkpoint_ops import measure_checkpoint_overhead
from lightning_vram.records import (
    Advice,
    AdviceId,
    BatchSizeChange,
    ChangeKind,
    CheckpointChange,
    CostBasis,
    DeviceInfo,
    ReplayedStep,
    RunSummary,
    SavingBasis,
    Simulation,
    StepChange,
    VariantResult,
)

SAME_FLOPS_ADVICE = frozenset({AdviceId.ALLOCATOR_FRAGMENTATION})
"""Advice whose simulated saving changes no op of the step (the allocator's settings): its cost is 0."""

_BASIS = {
    ChangeKind.CHECKPOINT: CostBasis.RECOMPUTED_FORWARD,
    ChangeKind.INPLACE: CostBasis.SAME_FLOPS,
    ChangeKind.FREE_GRADIENTS: CostBasis.SAME_FLOPS,
    ChangeKind.BATCH_SIZE: CostBasis.TWO_HALF_BATCHES,
    ChangeKind.PRECISION: CostBasis.OTHER_PRECISION,
    ChangeKind.LENGTH: CostBasis.FEWER_TOKENS,
    ChangeKind.TOKENS_PER_BATCH: CostBasis.FEWER_TOKENS,
}
"""What each kind of change's FLOP ratio says of the step time."""


_OWN_KINDS = {
    AdviceId.ACTIVATION_CHECKPOINTING: frozenset({ChangeKind.CHECKPOINT}),
    AdviceId.INPLACE_ACTIVATIONS: frozenset({ChangeKind.INPLACE}),
    AdviceId.MIXED_PRECISION: frozenset({ChangeKind.PRECISION}),
    AdviceId.STALE_GRADIENTS: frozenset({ChangeKind.FREE_GRADIENTS}),
    AdviceId.LONG_TAIL: frozenset({ChangeKind.LENGTH, ChangeKind.TOKENS_PER_BATCH}),
}
"""The kinds of change each rule replays for its own advice."""


@dataclass(frozen=True)
class TimeCost:
    """A change's step-time cost: ``seconds`` a step (``None``: not modelled), the FLOP ``ratio``, its ``basis``."""

    seconds: float | None
    ratio: float
    basis: CostBasis


def time_cost(
    change: StepChange, baseline: ReplayedStep, variant: ReplayedStep, step_seconds: float | None
) -> TimeCost | None:
    """The cost of ``change`` (replayed as ``variant`` beside ``baseline``) on a step measured at ``step_seconds``.

    ``None`` where either replay's FLOPs were not counted or the baseline counted none. A halved batch is advised
    with ``accumulate_grad_batches=2``: two half steps take the place of one, so its ratio is twice the replay's.

    >>> from lightning_vram.records import InplaceChange
    >>> step = ReplayedStep("cpu", "32-true", 8, {}, (), 0, 0.0, flops=1000)
    >>> time_cost(InplaceChange(("act",)), step, step, 0.5)
    TimeCost(seconds=0.0, ratio=1.0, basis=<CostBasis.SAME_FLOPS: 'same FLOPs'>)
    """
    if baseline.flops is None or variant.flops is None or baseline.flops <= 0:
        return None
    ratio = variant.flops / baseline.flops
    if isinstance(change, BatchSizeChange):
        ratio *= 2
    basis = _BASIS[change.kind]
    seconds = step_seconds * (ratio - 1) if basis.modelled and step_seconds is not None else None
    return TimeCost(seconds, ratio, basis)


@dataclass(frozen=True)
class RecomputeCosts:
    """Replayed checkpointing plans' recomputation, priced alike.

    ``values``: in predicted seconds a step where ``seconds`` (the recomputed ops alone, on ``priced_on``: not
    calibrated by the run's step time), else in recomputed FLOPs a step. ``work``: each plan's recomputed FLOPs and
    bytes moved (``None``: not counted), what :meth:`least` holds alike.
    """

    values: tuple[float, ...]
    seconds: bool
    work: tuple[Work | None, ...] = ()
    priced_on: str | None = None

    def text(self, index: int) -> str:
        """Plan ``index``'s cost, with its unit.

        >>> RecomputeCosts((0.0551, 2.4e9), True).text(0), RecomputeCosts((2.4e9,), False).text(0)
        ('55.1 ms', '2.4 GFLOPs')
        """
        value = self.values[index]
        return f"{1000 * value:.1f} ms" if self.seconds else f"{value / 1e9:.1f} GFLOPs"

    def least(self) -> frozenset[int]:
        """The plans that recompute as little as the cheapest (:func:`~lightning_vram.advice.cost_ties.least_alike`).

        >>> sorted(RecomputeCosts((0.0120, 0.0100, 0.0103), True, ((9, 9), (5, 9), (6, 9))).least())
        [1, 2]
        """
        work = self.work or (None,) * len(self.values)
        return least_alike(self.values, work, self.seconds)


def recompute_costs(
    steps: Sequence[ReplayedStep | None], baseline: ReplayedStep | None, device: DeviceInfo
) -> RecomputeCosts | None:
    """Each replayed checkpointing plan's recomputation (``steps``: their replays), priced as the budget search does.

    Predicted seconds on ``device`` where every step's ops were counted and the device's peaks are known
    (:func:`~lightning_vram.advice.budget.recomputation_seconds`: the recomputed ops by the step-time model, on the
    CPU with checkpointing's own overhead an op, units checkpointed whole); else the FLOPs each step adds to
    ``baseline``'s where all were counted; ``None`` where neither (a step missing). With each, the work the step
    recomputes (:func:`recomputed_work`).
    """
    if not steps or any(step is None for step in steps):
        return None
    replays = [step for step in steps if step is not None]
    work = tuple(recomputed_work(step) for step in replays)
    if all(step.work is not None for step in replays):
        peaks = device_peaks(device, replays)
        if peaks is not None:
            overhead = measure_checkpoint_overhead(peaks.op_overhead_seconds) if device.type == "cpu" else None
            seconds = [recomputation_seconds(step, peaks, overhead) for step in replays]
            return RecomputeCosts(tuple(value or 0.0 for value in seconds), True, work, peaks.name)
    if baseline is None or baseline.flops is None or any(step.flops is None for step in replays):
        return None
    flops = tuple(float(max((step.flops or 0) - baseline.flops, 0)) for step in replays)
    return RecomputeCosts(flops, False, work)


def recomputed_work(step: ReplayedStep) -> Work | None:
    """The FLOPs and bytes moved of ``step``'s recomputed ops (``None``: its ops were not counted).

    >>> from lightning_vram.records import OpGroup, Phase, StepWork
    >>> group = OpGroup(Phase.BACKWARD, "fp32", 100, 64, 2, recomputed=True, op="relu")
    >>> recomputed_work(ReplayedStep("cpu", "32-true", 8, {}, (), 0, 0.0, work=StepWork((group,))))
    (200, 128)
    """
    if step.work is None:
        return None
    recomputed = step.work.recomputed()
    return (recomputed.flops, recomputed.bytes_moved)


def cheapest_alike(
    variants: Sequence[VariantResult], baseline: ReplayedStep | None, device: DeviceInfo
) -> VariantResult:
    """Of checkpointing ``variants`` (replayed, in the simulation's order) that save alike, the one advised.

    Of those that recompute least (:meth:`RecomputeCosts.least`: the same work, or predicted times within the
    tolerance), the least recomputed work as counted, then the fewest recomputed modules, then the fewest units, then
    the first: the order the checkpointing advice breaks a tie in, so that its step time is its own plan's.
    """
    costs = recompute_costs([variant.replayed for variant in variants], baseline, device)
    least = costs.least() if costs is not None else frozenset(range(len(variants)))
    work = costs.work if costs is not None and costs.work else (None,) * len(variants)

    def key(index: int) -> tuple[bool, Work, int, int, int]:
        change = variants[index].change
        plan = change.plan if isinstance(change, CheckpointChange) else None
        modules, units = (recomputed_modules(plan), len(plan.units)) if plan is not None else (0, 0)
        return (index not in least, counted_work(work[index]), modules, units, index)

    return variants[min(range(len(variants)), key=key)]


def _variant_of(advice: Advice, simulation: Simulation, device: DeviceInfo) -> VariantResult | None:
    """The replayed change behind ``advice``: the variant whose replayed peak is the advice's predicted peak.

    A variant of the kind the advice's rule replays comes first (two changes can replay to the same peak); any other
    kind is a remedy the advice lists (near capacity lists checkpointing, a halved batch...). Of checkpointing plans
    replayed to the same peak, the one the checkpointing advice picks (:func:`cheapest_alike`).
    """
    own = _OWN_KINDS.get(advice.id, frozenset())
    matching = [
        variant
        for variant in sorted(simulation.variants, key=lambda variant: variant.change.kind not in own)
        if variant.replayed is not None
        and variant.replayed.reported_bytes(variant.replayed.reported_peak) == advice.predicted_peak_bytes
    ]
    alike = [
        variant for variant in matching if variant.change.kind in own and isinstance(variant.change, CheckpointChange)
    ]
    if len(alike) > 1:
        return cheapest_alike(alike, simulation.baseline, device)
    return matching[0] if matching else None


def with_replayed_change(advice: Advice, summary: RunSummary, simulation: Simulation | None) -> Advice:
    """``advice`` naming the replayed change behind its simulated saving (``replayed_change``), else as it is.

    The figure of the step's memory draws that change's replay, and two changes can replay to the same peak (3 and 4
    segments of one stack): the one the advice prints (:func:`_variant_of`), not the first.
    """
    baseline = simulation.baseline if simulation is not None and simulation.skipped is None else None
    if simulation is None or baseline is None or advice.saving_basis is not SavingBasis.SIMULATED:
        return advice
    variant = _variant_of(advice, simulation, summary.device) if advice.predicted_peak_bytes is not None else None
    return replace(advice, replayed_change=variant.change.label) if variant is not None else advice


def with_time_cost(advice: Advice, summary: RunSummary, simulation: Simulation | None) -> Advice:
    """``advice`` with its step-time cost, where its change was replayed with FLOPs counted (else as it is).

    The run's median step time (``summary.step_seconds_median``) prices the FLOP ratio; without it the ratio is
    given and the seconds are ``None``. It also calibrates the change's predicted step time
    (:func:`predicted_step_seconds`); advice that changes no op (the allocator's settings) keeps the measured one.
    Where the change's step time is predicted, the cost is that prediction less the median: the cost and the
    predicted step time printed beside it add up.
    """
    baseline = simulation.baseline if simulation is not None and simulation.skipped is None else None
    if simulation is None or baseline is None or baseline.flops is None:
        return advice
    step_seconds = summary.step_seconds_median
    variant: VariantResult | None = None
    if advice.id in SAME_FLOPS_ADVICE and advice.saving_basis is SavingBasis.SIMULATED:
        found: TimeCost | None = TimeCost(None if step_seconds is None else 0.0, 1.0, CostBasis.SAME_FLOPS)
    elif advice.predicted_peak_bytes is not None:
        variant = _variant_of(advice, simulation, summary.device)
        replayed = variant.replayed if variant is not None else None
        found = time_cost(variant.change, baseline, replayed, step_seconds) if variant and replayed else None
    else:
        found = None
    if found is None:
        return advice
    predicted = step_seconds if found.basis is CostBasis.SAME_FLOPS and baseline.work is not None else None
    if advice.predicted_peak_bytes is not None and variant is not None and variant.replayed is not None:
        predicted = predicted_step_seconds(variant.change, baseline, variant.replayed, step_seconds, summary.device)
    seconds = found.seconds
    if seconds is not None and predicted is not None and step_seconds is not None:
        seconds = predicted - step_seconds  # one figure: the cost is the predicted step's excess over the run's
    return replace(
        advice,
        estimated_cost_seconds=seconds,
        flop_ratio=found.ratio,
        cost_basis=found.basis,
        predicted_step_seconds=predicted,
    )


def device_peaks(device: DeviceInfo, steps: Sequence[ReplayedStep] = ()) -> DevicePeaks | None:
    """The peaks ``steps`` on ``device`` are priced with: the CPU measured, a GPU of the table (``None``: unknown).

    On the CPU only the kinds of op the steps run are measured beyond the matrix products and the copy.
    """
    if device.type == "cpu":
        return measure_host_peaks({group.op for step in steps if step.work for group in step.work.groups})
    if device.type == "cuda":
        return gpu_peaks(device.name)
    return None


def predicted_step_seconds(
    change: StepChange,
    baseline: ReplayedStep,
    variant: ReplayedStep,
    step_seconds: float | None,
    device: DeviceInfo,
) -> float | None:
    """The step time with ``change``: ``variant``'s prediction, calibrated by the run's measured ``step_seconds``.

    A halved batch is two half steps. ``None`` without a measured step time, counted ops or the device's peaks.
    """
    if step_seconds is None or step_seconds <= 0 or baseline.work is None or variant.work is None:
        return None
    peaks = device_peaks(device, (baseline, variant))
    if peaks is None:
        return None
    run = calibrated(predict_step_time(baseline, peaks), step_seconds)
    seconds = predict_step_time(variant, peaks, calibration=run.calibration).seconds
    return 2 * seconds if isinstance(change, BatchSizeChange) else seconds
