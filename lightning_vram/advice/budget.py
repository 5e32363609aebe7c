"""Checkpointing chosen for a memory budget: the plan with the least recomputation time whose replayed step fits it.

"Fits" is what the step would hold: on CUDA (a predictor that simulates the caching allocator) the simulated
allocator serves the whole replayed step within the budget (:func:`~lightning_vram.prediction.replay.serves.serve`),
elsewhere the replayed live peak is at or under it.

The candidates are the units the checkpointing advice plans with (:mod:`~lightning_vram.advice.checkpointing`): in
each module with two or more children that ran, its children as units (a child starting with an inplace op joins
the one before it; a unit that saved nothing, or holds a module that outran its caller, is never checkpointed),
all layer stacks (``nn.ModuleList``s of numbered layers) together where there are several, and the blocks of all
stages (called containers of numbered blocks, a ResNet's ``layer1`` to ``layer4``) together, and those blocks with
the modules around the stages that are modelled to free bytes with them (a stem: ``self.stem``, or torchvision's
``conv1``, ``bn1``, ``relu`` as one unit; :func:`_around_stages`). A plan is any subset of one such container's units.

A plan's cost is the time its recomputation is predicted to take: the ops its replay counted as recomputed in
backward, each priced by the step-time model (:func:`~lightning_vram.prediction.timing.predict_step_time`: the
slower of its FLOPs at the device's peak FLOP/s and its bytes moved at the device's bandwidth, plus an op's
overhead) on the run's device: the host's measured peaks for the CPU, the GPU table's row for CUDA (for CUDA without
a device, :data:`REFERENCE_GPU`'s). FLOPs alone do not price it: selective checkpointing keeps the matrix products
and recomputes the elementwise ops, normalisations and softmaxes, which count 0 FLOPs but are memory-bound, not free
(a trial's 4-layer transformer LM: its all-selective plan counted 0 FLOPs and measured +34% a step on a CPU, slower
than two layers checkpointed whole). On the CPU each recomputed op also carries what checkpointing itself adds to
it, measured once a process (:mod:`~lightning_vram.prediction.timing.checkpoint_ops`: saved-tensor hooks, and
selective checkpointing's Python dispatch mode in forward and recompute, several times an op's own cost); the ops of
a plan's whole units are those its units recomputed checkpointed whole alone (step 2 below), the rest are its
selective units'. On a GPU that overhead is host time, overlapped by the device's work where its kernels outlast it,
and is not added. The recomputed FLOPs are kept beside the time; where the device has no peaks (no row of the table,
another device type), plans are compared by their FLOPs.

Replays are the expensive part, so the search replays few:

1. the baseline, its FLOPs counted: a budget it meets needs no checkpointing;
2. each kind of unit (the same module types and bytes: a stack's layers are one kind) checkpointed whole alone,
   once: its recomputation's cost;
3. a greedy order: the unit whose checkpointing lowers the modelled peak (:func:`plan_peak`) most per second of
   recomputation next, until every unit is in;
4. the smallest prefix of that order whose replayed step fits, bisected by replay (the modelled answer probed
   first): checkpointed selectively, checkpointed whole, and (with ``w`` the fewest whole units that fit) each
   ``c`` below ``w`` whole units followed by the fewest selective ones that fit. A mixed plan whose whole units
   alone are costed (step 2) at or above the cheapest plan found is not replayed.

The search is over prefixes of one order, not every subset: a plan that fits with a unit left out of the prefix
before a unit in it is not tried (the greedy puts the units that save most per second first, and a stack's layers,
one kind, cost the same).

Containers are tried by their modelled saving, the largest first, at most :data:`MAX_CONTAINERS` and while the
predictor's budget of seconds lasts; once a plan fits, a container modelled to save less than the budget needs is
passed over. The stages' blocks with a stem come last, searched only where no plan of the others fits: a stem first
in the greedy order would make every prefix recompute it, where blocks alone fit for less (a trial's ResNet at half
its peak: the stem and five blocks instead of five blocks). A plan replayed for one container is not replayed again
for another. Of the plans that fit, those whose recomputation is predicted to take least time are the ones that
recompute the same work as the cheapest (the same recomputed FLOPs and bytes moved) or are predicted within
:data:`~lightning_vram.advice.cost_ties.COST_TOLERANCE` of it: the host's peaks, measured in the process, move with
the machine's load. Of those, the least recomputed work as counted (FLOPs, then bytes moved), then the lowest peak,
then the fewest units, then the units' names: nothing the timing changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_vram.advice.checkpoint_code import CodeContext, checkpoint_snippet
from lightning_vram.advice.checkpointing import (
    Outside,
    ProfileIndex,
    Unit,
    is_stack,
    plan_peak,
    recomputes_scripted,
    shared_units,
    starts_inplace,
    unit_groups,
)
from lightning_vram.advice.cost_ties import Work, counted_work, least_alike
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.serves import serves_step
from lightning_vram.prediction.timing import GPU_PEAKS, DevicePeaks, gpu_peaks, measure_host_peaks, predict_step_time
from lightning_vram.prediction.timing.checkpoint_ops import CheckpointOverhead, measure_checkpoint_overhead
from lightning_vram.records import CheckpointChange, CheckpointPlan, ReplayedStep
from lightning_vram.records.budget import BudgetPlan, peak_text
from lightning_vram.units import format_bytes

MAX_CONTAINERS = 3
"""Containers whose plans are searched by replay, the largest modelled saving first."""

REFERENCE_GPU = "A100 80GB SXM"
"""The GPU table's row that prices recomputation for CUDA where no device says which card it is."""

LIVE_PEAK = "live peak"
RESERVED = "reserved, simulated caching allocator"


@dataclass(frozen=True)
class _Container:
    """One container's units in the order they run, which of them may be checkpointed, and where they are called."""

    name: str
    units: list[Unit]
    eligible: list[int]
    outside: Outside
    forward_of: str | None
    together: bool = False
    """Units of several modules' children (stacks' layers, stages' blocks and a stem): put in place by the wrapper."""
    around: bool = False
    """The stages' blocks with the modules around them (:func:`_around_stages`): searched where nothing else fits."""

    def plan(self, chosen: set[int], saving: int = 0, selective: frozenset[int] = frozenset()) -> CheckpointPlan:
        """The plan checkpointing units ``chosen`` (indices) whole and ``selective`` selectively, in run order."""
        every = sorted(chosen | selective)
        units = tuple(self.units[index].names for index in every)
        kept = tuple(self.units[index].names[0] for index in every if index in selective)
        shared = shared_units(self.units[index] for index in every)
        return CheckpointPlan(self.name, units, None, saving, self.forward_of, selective=kept, shared=shared)

    @property
    def wrapped(self) -> bool:
        """Whether the wrapper puts its plans in place (selective ones too): units of several parents, or one-module."""
        return self.together or all(len(self.units[index].names) == 1 for index in self.eligible)

    def modelled(self, chosen: set[int]) -> int:
        """The activation bytes :func:`plan_peak` models with ``chosen`` checkpointed."""
        flags = [index in chosen for index in range(len(self.units))]
        return plan_peak(self.units, flags, *self.outside)


@dataclass(frozen=True)
class _Tried:
    """One replayed plan: whether it fits, its peak and allocated peak (bytes), its recomputed FLOPs and seconds.

    ``peak`` is as the budget counts it (reserved or live), ``allocated`` what the step's tensors hold. ``seconds``:
    the recomputation's predicted time (``None``: not priced). ``work``: the recomputed ops' FLOPs and bytes moved
    (``None``: not counted).
    """

    plan: CheckpointPlan
    fits: bool
    peak: int
    flops: int | None
    allocated: int
    seconds: float | None
    work: Work | None = None

    @property
    def cost(self) -> float:
        """What plans are compared on: the predicted seconds, else the FLOPs (0 where neither is known)."""
        if self.seconds is not None:
            return self.seconds
        return float(self.flops or 0)


class _Search:
    """The replays of one budget's search, counted, against one baseline."""

    def __init__(self, predictor: Predictor, budget: int, baseline: ReplayedStep) -> None:
        self.predictor = predictor
        self.budget = budget
        self.baseline = baseline
        self.peaks: DevicePeaks | None = None
        self.overhead: CheckpointOverhead | None = None
        self.replays = 1
        self.replayed: dict[tuple[object, ...], ReplayedStep | None] = {}
        self.basis = RESERVED if baseline.allocations is not None and predictor.allocator is not None else LIVE_PEAK

    def measure(self, step: ReplayedStep) -> tuple[bool, int]:
        """Whether ``step`` fits the budget, and its peak as the budget counts it (bytes)."""
        if self.basis == RESERVED:
            unseen = self.predictor.unseen_bytes
            serving = serves_step(step, self.budget, unseen_bytes=unseen or None)
            if serving is not None and serving.served:
                return True, serving.reserved_peak_bytes
            extra = max(unseen.values(), default=0)
            return False, max((phase.reserved_bytes or 0) for phase in step.phases.values()) + extra
        peak = step.peak.peak_bytes
        return peak <= self.budget, peak

    def replay(self, plan: CheckpointPlan) -> ReplayedStep | None:
        """The step with ``plan`` applied, its FLOPs counted; ``None`` where it could not be replayed.

        Each plan is replayed once, whichever container it came from (its units and their kind of checkpointing).
        """
        key = (plan.units, plan.selective)
        if key not in self.replayed:
            self.replays += 1
            step = self.predictor.replay(CheckpointChange(plan), count_flops=True)
            self.replayed[key] = step if isinstance(step, ReplayedStep) else None
        return self.replayed[key]

    def recomputed(self, step: ReplayedStep) -> int | None:
        """The FLOPs ``step`` adds to the baseline's (never negative); ``None`` where either was not counted."""
        if step.flops is None or self.baseline.flops is None:
            return None
        return max(step.flops - self.baseline.flops, 0)

    def seconds(self, step: ReplayedStep, whole_ops: int | None = None) -> float | None:
        """The predicted time of ``step``'s recomputation; ``None`` without the device's peaks or counted ops.

        With the checkpointing overhead measured (:attr:`overhead`), each recomputed op adds its share: the first
        ``whole_ops`` of them (``None``: all) in units checkpointed whole, the rest in selective ones.
        """
        if self.peaks is None:
            return None
        return recomputation_seconds(step, self.peaks, self.overhead, whole_ops)

    def seconds_of(self, step: ReplayedStep) -> float:
        """The predicted time of the whole of ``step`` (its ops counted, the device's peaks known)."""
        assert self.peaks is not None
        return predict_step_time(step, self.peaks).seconds

    def cost(self, step: ReplayedStep) -> float | None:
        """What ``step``'s recomputation (units checkpointed whole) costs: its predicted seconds, else its FLOPs.

        ``None`` where neither.
        """
        if self.peaks is not None:
            return self.seconds(step)
        flops = self.recomputed(step)
        return None if flops is None else float(flops)


def recomputation_seconds(
    step: ReplayedStep, peaks: DevicePeaks, overhead: CheckpointOverhead | None, whole_ops: int | None = None
) -> float | None:
    """The predicted seconds of ``step``'s recomputation on ``peaks``, ``None`` where its ops were not counted.

    The recomputed ops priced by the step-time model, and with ``overhead``, what checkpointing adds to each: the
    first ``whole_ops`` of them (``None``: all) in units checkpointed whole, the rest in selective ones.
    """
    if step.work is None:
        return None
    seconds = predict_step_time(step, peaks).recompute_seconds
    if overhead is None:
        return seconds
    ops = step.work.recomputed().ops
    whole = ops if whole_ops is None else min(whole_ops, ops)
    return seconds + whole * overhead.whole + (ops - whole) * overhead.selective


def _device_peaks(predictor: Predictor, baseline: ReplayedStep) -> DevicePeaks | None:
    """The peaks recomputation is priced with on the predictor's device (``None``: none known, or no ops counted).

    The CPU: the host's, measured once a process (the kinds of op the baseline runs). CUDA: the table's row for the
    device's name, :data:`REFERENCE_GPU`'s where no device is there to name it.
    """
    if baseline.work is None:
        return None
    placement = predictor.device
    if placement.type == "cpu":
        return measure_host_peaks({group.op for group in baseline.work.groups})
    if placement.type == "cuda":
        if torch.cuda.is_available():
            return gpu_peaks(torch.cuda.get_device_name(placement))
        return GPU_PEAKS[REFERENCE_GPU]
    return None


def _containers(indexed: ProfileIndex) -> list[_Container]:
    """Every container with two or more units, every layer stack together, the blocks of every stage together.

    The largest modelled saving first; then the stages' blocks with the modules around them (searched last).
    """
    found: list[tuple[str, list[list[str]], str | None, bool, bool, bool]] = []
    for container, names in indexed.children.items():
        groups = unit_groups(indexed, names)
        if len(groups) < 2:
            continue
        profile = indexed.called.get(container)
        sequential = profile is not None and profile.type == "Sequential"
        forward_of: str | None = container if container in indexed.called else indexed.caller(container)
        found.append((container, groups, forward_of, sequential, False, False))
    for together, stages in ((_stacks(indexed), False), (_block_sequences(indexed), True)):
        if len(together) >= 2:
            layers = sorted(
                (layer for name in together for layer in indexed.children[name]), key=indexed.order.__getitem__
            )
            groups = [[name] for name in layers]
            holder = _common_ancestor(together)
            found.append((holder, groups, indexed.caller(layers[0]) or None, False, True, False))
            around = _around_stages(indexed, together, layers) if stages else []
            if around:
                groups = sorted([*groups, *around], key=lambda group: indexed.order[group[0]])
                found.append((holder, groups, indexed.caller(groups[0][0]) or None, False, True, True))
    containers = []
    for name, groups, forward_of, one_module_only, several, stem in found:
        units = [indexed.unit(group) for group in groups]
        eligible = [
            index
            for index, (group, unit) in enumerate(zip(groups, units, strict=True))
            if unit.saved > 0
            and not (index == 0 and starts_inplace(indexed, group[0]))
            # an nn.Sequential's children are put in place one by one: a unit of several is left out
            and not (one_module_only and len(group) > 1)
            and not recomputes_scripted(indexed, CheckpointPlan(name, (tuple(group),), None, 0))
        ]
        if eligible:
            containers.append(_Container(name, units, eligible, indexed.outside(groups), forward_of, several, stem))
    ranked = sorted(containers, key=lambda c: c.modelled(set()) - c.modelled(set(c.eligible)), reverse=True)
    return [container for container in ranked if not container.around] + [c for c in ranked if c.around]


def _stacks(indexed: ProfileIndex) -> list[str]:
    """The layer stacks (``nn.ModuleList``s of numbered layers, never called themselves): an encoder's, a decoder's."""
    return [container for container in indexed.children if is_stack(indexed, container)]


def _block_sequences(indexed: ProfileIndex) -> list[str]:
    """The called containers of numbered blocks (modules with children of their own): a ResNet's stages.

    Their blocks together are one container: a budget that no stage's blocks alone meet may be met by blocks of
    several (every block of every stage), and the cheapest plan may take blocks of two stages. Containers of numbered
    single modules (a ``Sequential`` of convolutions, normalisations and activations) are not blocks.
    """
    return [
        container
        for container, names in indexed.children.items()
        if container in indexed.called
        and len(names) >= 2
        and all(name.rpartition(".")[2].isdigit() and indexed.children.get(name) for name in names)
    ]


def _around_stages(indexed: ProfileIndex, stages: list[str], blocks: list[str]) -> list[list[str]]:
    """Units of the other children of the module holding ``stages`` (a stem, a head) modelled to free bytes with them.

    A budget that every block of every stage does not meet may be met with the stem (a convolution, a normalisation,
    a ReLU at the input's resolution) checkpointed too. Candidates: each child that is a unit of one module
    (``self.stem``; the wrapper puts it in place whoever calls it), and the run of children called before the first
    stage (a torchvision ResNet's ``conv1``, ``bn1``, ``relu``, ``maxpool``) as one unit, where the holder is no
    ``nn.Sequential``: the plan runs them one after the other on one tensor, as the replay checks its caller does
    (:mod:`~lightning_vram.prediction.replay.changes`). A candidate counts that saved something, does not start with
    an inplace op, holds no TorchScript and no module that outran its caller, and that :func:`plan_peak` models to
    lower the peak with ``blocks`` (the stages' blocks) all checkpointed: one that would not is left out, so the
    search replays it neither alone nor with the blocks. A one-module child inside a run that counts is left out.
    """
    holder = _common_ancestor(stages)
    siblings = indexed.children.get(holder, [])
    if any(stage not in siblings for stage in stages):
        return []
    candidates = [group for group in unit_groups(indexed, siblings) if len(group) == 1 and group[0] not in stages]
    first = min(indexed.order[stage] for stage in stages)
    stem = [name for name in siblings if indexed.order[name] < first]
    holder_profile = indexed.called.get(holder)
    if len(stem) > 1 and not (holder_profile is not None and holder_profile.type == "Sequential"):
        candidates.insert(0, stem)
    around: list[list[str]] = []
    for group in candidates:
        if (
            any(name in member for member in around for name in group)
            or sum(indexed.inclusive[name] for name in group) == 0
            or starts_inplace(indexed, group[0])
            or indexed.repeated(group)
            or recomputes_scripted(indexed, CheckpointPlan(holder, (tuple(group),), None, 0))
        ):
            continue
        groups = sorted([[name] for name in blocks] + [group], key=lambda member: indexed.order[member[0]])
        units = [indexed.unit(member) for member in groups]
        outside = indexed.outside(groups)
        with_blocks = [member is not group and unit.saved > 0 for member, unit in zip(groups, units, strict=True)]
        with_it = [flag or member is group for member, flag in zip(groups, with_blocks, strict=True)]
        if plan_peak(units, with_it, *outside) < plan_peak(units, with_blocks, *outside):
            around.append(group)
    return around


def _common_ancestor(names: list[str]) -> str:
    """The deepest module enclosing every one of ``names`` (``""``: the trained module).

    >>> _common_ancestor(["model.encoder.layers", "model.decoder.layers"])
    'model'
    """
    shared: list[str] = []
    for column in zip(*(name.split(".") for name in names), strict=False):
        if len(set(column)) > 1:
            break
        shared.append(column[0])
    return ".".join(shared)


def _kind(indexed: ProfileIndex, unit: Unit) -> tuple[object, ...]:
    """What makes two units recompute the same: their modules' types by relative name, and their bytes."""
    types = tuple(
        (name[len(first) :], profile.type)
        for first in unit.names
        for name, profile in indexed.called.items()
        if name == first or name.startswith(f"{first}.")
    )
    return (len(unit.names), types, unit.saved, unit.input_bytes)


def _unit_costs(search: _Search, indexed: ProfileIndex, container: _Container) -> dict[int, tuple[float, int]]:
    """Each eligible unit checkpointed whole: its cost (:meth:`_Search.cost`, above 0) and the ops it recomputes.

    One replay per kind of unit; a unit whose replay fails is left out.
    """
    by_kind: dict[tuple[object, ...], tuple[float, int] | None] = {}
    costs: dict[int, tuple[float, int]] = {}
    for index in container.eligible:
        kind = _kind(indexed, container.units[index])
        if kind not in by_kind:
            if search.predictor.out_of_time():
                break
            step = search.replay(container.plan({index}))
            ops = 0 if step is None or step.work is None else step.work.recomputed().ops
            by_kind[kind] = None if step is None else (max(search.cost(step) or 0.0, 1e-12), ops)
        cost = by_kind[kind]
        if cost is not None:
            costs[index] = cost
    return costs


def _greedy_order(container: _Container, costs: dict[int, float]) -> list[int]:
    """Units in the order the greedy adds them: the largest modelled peak reduction per unit of cost first."""
    chosen: set[int] = set()
    order: list[int] = []
    current = container.modelled(chosen)
    while len(order) < len(costs):
        best = max(
            (index for index in costs if index not in chosen),
            key=lambda index: ((current - container.modelled(chosen | {index})) / costs[index], -index),
        )
        chosen.add(best)
        order.append(best)
        current = container.modelled(chosen)
    return order


class _Probes:
    """The replayed plans of one container, by the units checkpointed whole and selectively (indices)."""

    def __init__(self, search: _Search, container: _Container, baseline_peak: int, unit_ops: dict[int, int]) -> None:
        self.search = search
        self.container = container
        self.baseline_peak = baseline_peak
        self.unit_ops = unit_ops
        self.tried: dict[tuple[frozenset[int], frozenset[int]], _Tried | None] = {}

    def __call__(self, whole: frozenset[int], selective: frozenset[int] = frozenset()) -> _Tried | None:
        """The plan replayed (once): ``None`` where it could not be, or the budget of seconds ran out."""
        key = (whole, selective)
        if key not in self.tried:
            if self.search.predictor.out_of_time():
                return None
            step = self.search.replay(self.container.plan(set(whole), selective=selective))
            if step is None:
                self.tried[key] = None
            else:
                fits, peak = self.search.measure(step)
                plan = self.container.plan(set(whole), self.baseline_peak - peak, selective)
                recomputed = self.search.recomputed(step)
                seconds = self.search.seconds(step, sum(self.unit_ops[index] for index in whole))
                work = None if step.work is None else (step.work.recomputed().flops, step.work.recomputed().bytes_moved)
                self.tried[key] = _Tried(plan, fits, peak, recomputed, step.peak.peak_bytes, seconds, work)
        return self.tried[key]

    def lowest(self) -> _Tried | None:
        """The replayed plan with the lowest peak."""
        return min((tried for tried in self.tried.values() if tried is not None), key=lambda t: t.peak, default=None)


def _smallest(probe: Callable[[int], _Tried | None], top: int, guess: int) -> tuple[int, _Tried] | None:
    """The smallest count from 1 to ``top`` whose plan fits (0 is known not to), bisected from ``guess`` first."""
    low, high = 0, top
    first = probe(guess)
    if first is not None and first.fits:
        high = guess
    else:
        low = guess
        if guess == top:
            return None
        whole = probe(top)
        if whole is None or not whole.fits:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        result = probe(middle)
        if result is None:
            break
        if result.fits:
            high = middle
        else:
            low = middle
    found = probe(high)
    return (high, found) if found is not None else None


def _search_container(probes: _Probes, order: list[int], costs: dict[int, float], selective: bool) -> list[_Tried]:
    """The plans that fit with the fewest units of ``order`` checkpointed, whole, selectively, and both.

    With ``selective``, the smallest prefix of selective units; then the smallest of whole units (``w`` of them);
    then, with ``selective``, for each count ``c`` below ``w``, ``c`` whole units followed by the fewest selective
    ones that fit, skipped where those whole units' ``costs`` alone reach the cheapest plan found.
    """
    container = probes.container
    modelled = [container.modelled(set(order[:count])) for count in range(len(order) + 1)]
    excess = probes.baseline_peak - probes.search.budget
    guess = next((count for count in range(1, len(order) + 1) if modelled[0] - modelled[count] >= excess), len(order))
    found: list[_Tried] = []
    if selective:
        kept = _smallest(lambda count: probes(frozenset(), frozenset(order[:count])), len(order), len(order))
        if kept is not None:
            found.append(kept[1])
    whole = _smallest(lambda count: probes(frozenset(order[:count])), len(order), guess)
    if whole is not None:
        found.append(whole[1])
    if not selective or whole is None:
        return found
    for count in range(whole[0] - 1, 0, -1):
        if sum(costs[index] for index in order[:count]) >= min(tried.cost for tried in found):
            continue  # its whole units alone cost as much as a plan that fits
        mixed = _smallest(_mixed(probes, order, count), len(order) - count, len(order) - count)
        if mixed is not None:
            found.append(mixed[1])
    return found


def _mixed(probes: _Probes, order: list[int], whole: int) -> Callable[[int], _Tried | None]:
    """The probe of ``whole`` units of ``order`` checkpointed whole and the next ``count`` selectively."""

    def probe(count: int) -> _Tried | None:
        return probes(frozenset(order[:whole]), frozenset(order[whole : whole + count]))

    return probe


def plan_for_budget(
    predictor: Predictor,
    budget_bytes: int,
    baseline: ReplayedStep | None = None,
    context: CodeContext | None = None,
    progress: Callable[[str], None] | None = None,
    selective: bool = True,
    peaks: DevicePeaks | None = None,
) -> BudgetPlan | str:
    """The checkpointing plan with the least predicted recomputation time whose replayed step fits ``budget_bytes``.

    ``baseline``: the step as it is, replayed with its FLOPs counted (replayed here when ``None``). ``context``: what
    the printed code is written for (default: a LightningModule). Returns why not where the step cannot be
    replayed. ``progress``: told of each container searched (for benchmarks). ``selective``: also try selective
    checkpointing (the outputs of matrix products and attention kept) in containers whose plans the wrapper puts in
    place (one-module units, or units of several modules' children together). ``peaks``:
    the device recomputation is priced on (``None``: the predictor's, see :func:`_device_peaks`).
    """
    if baseline is None or baseline.flops is None:
        replayed = predictor.replay(None, count_flops=True)
        if not isinstance(replayed, ReplayedStep):
            return replayed.reason
        baseline = replayed
    search = _Search(predictor, budget_bytes, baseline)
    fits, baseline_peak = search.measure(baseline)
    baseline_allocated = baseline.peak.peak_bytes
    if fits:
        peak = peak_text(search.basis == RESERVED, baseline_peak, baseline_allocated)
        return BudgetPlan(
            budget_bytes=budget_bytes,
            baseline_peak_bytes=baseline_peak,
            step_flops=baseline.flops,
            fits=True,
            plan=None,
            peak_bytes=baseline_peak,
            recomputed_flops=0,
            what=None,
            code=None,
            reason=f"the step peaks at {peak} without checkpointing: no recomputation needed",
            replays=search.replays,
            basis=search.basis,
            allocated_peak_bytes=baseline_allocated,
            baseline_allocated_bytes=baseline_allocated,
        )
    search.peaks = peaks if peaks is not None else _device_peaks(predictor, baseline)
    if search.peaks is not None and predictor.device.type == "cpu":
        search.overhead = measure_checkpoint_overhead(search.peaks.op_overhead_seconds)
    indexed = ProfileIndex(baseline.modules)
    excess = baseline_peak - budget_bytes
    fitting: list[tuple[_Tried, _Container, int]] = []
    lowest: _Tried | None = None
    searched = 0
    for container in _containers(indexed):
        if predictor.out_of_time() or (container.around and fitting):
            break  # a stem is searched with the blocks only where no plan without it fits
        if searched >= MAX_CONTAINERS and not container.around:
            continue
        if fitting and container.modelled(set()) - container.modelled(set(container.eligible)) < excess:
            continue  # modelled to save too little, and a plan fits already
        searched += 1
        if progress is not None:
            progress(f"searching {container.name or 'the model'} ({len(container.eligible)} units)")
        measured = _unit_costs(search, indexed, container)
        if not measured:
            continue
        costs = {index: cost for index, (cost, _) in measured.items()}
        order = _greedy_order(container, costs)
        probes = _Probes(search, container, baseline_peak, {index: ops for index, (_, ops) in measured.items()})
        for chosen in _search_container(probes, order, costs, selective and container.wrapped):
            fitting.append((chosen, container, len(order)))
        smallest = probes.lowest()
        if smallest is not None and (lowest is None or smallest.peak < lowest.peak):
            lowest = smallest
    if not fitting:
        return _nothing_fits(search, lowest, searched)
    best, container, candidates = _cheapest(fitting, search.peaks is not None)
    what, code = checkpoint_snippet(best.plan, context)
    kept = f" ({len(best.plan.selective)} selectively)" if best.plan.selective else ""
    least = "the least predicted recomputation time" if search.peaks is not None else "the fewest recomputed FLOPs"
    reason = (
        f"{len(best.plan.units)}{kept} of {candidates} units of {_container_text(container.name)}, {least} of the"
        f" {len(fitting)} plan(s) that fit ({searched} container(s) searched, {search.replays} replays)"
    )
    if predictor.out_of_time():
        reason += "; the search stopped when budget_seconds ran out: a plan recomputing less may fit"
    return BudgetPlan(
        budget_bytes=budget_bytes,
        baseline_peak_bytes=baseline_peak,
        step_flops=baseline.flops,
        fits=True,
        plan=best.plan,
        peak_bytes=best.peak,
        recomputed_flops=best.flops,
        what=what,
        code=code,
        reason=reason,
        replays=search.replays,
        basis=search.basis,
        allocated_peak_bytes=best.allocated,
        baseline_allocated_bytes=baseline_allocated,
        recompute_seconds=best.seconds,
        step_seconds=None if search.peaks is None or baseline.work is None else search.seconds_of(baseline),
        timed_on=None if search.peaks is None else search.peaks.name,
    )


def _cheapest(fitting: list[tuple[_Tried, _Container, int]], seconds: bool) -> tuple[_Tried, _Container, int]:
    """Of the plans that fit, one of those recomputing least (the module's doc), by work counted, peak, units, names.

    ``seconds``: the plans are priced in predicted seconds (else in FLOPs).
    """
    least = least_alike([tried.cost for tried, _, _ in fitting], [tried.work for tried, _, _ in fitting], seconds)
    return min(
        (fitting[index] for index in least),
        key=lambda item: (
            counted_work(item[0].work),
            item[0].peak,
            len(item[0].plan.units),
            item[0].plan.units,
            item[0].plan.selective,
        ),
    )


def _container_text(name: str | None) -> str:
    """A container in words: its name as code, or "the model" for the root.

    >>> _container_text("encoder.layers"), _container_text("")
    ('`encoder.layers`', 'the model')
    """
    return f"`{name}`" if name else "the model"


def _nothing_fits(search: _Search, lowest: _Tried | None, searched: int) -> BudgetPlan:
    """The record of a budget no replayed plan meets: the smallest peak reached, and by which plan."""
    baseline_peak = search.measure(search.baseline)[1]
    parts = search.baseline.peak.breakdown
    state = ""
    if parts is not None:
        model_state = parts.parameters + parts.gradients + parts.optimizer_state
        state = f"; parameters, gradients and optimizer state alone hold {format_bytes(model_state)}"
    if lowest is None:
        reason = f"no checkpointing plan could be replayed ({searched} container(s) searched){state}"
    else:
        units = lowest.plan.units
        kept = f" ({len(lowest.plan.selective)} selectively)" if lowest.plan.selective else ""
        peak = peak_text(search.basis == RESERVED, lowest.peak, lowest.allocated)
        reason = (
            f"the smallest peak the search reached is {peak}, checkpointing {len(units)} unit(s){kept} of"
            f" {_container_text(lowest.plan.container)}, {format_bytes(lowest.peak - search.budget)} over the"
            f" budget (it tries the children of one module at a time, and the layers of several stacks or the blocks"
            f" of several stages, with a stem of one module, together: other units together may peak lower){state}"
        )
    if search.predictor.out_of_time():
        reason += f" (the search stopped when budget_seconds ran out, after {search.replays} replays)"
    return BudgetPlan(
        budget_bytes=search.budget,
        baseline_peak_bytes=baseline_peak,
        step_flops=search.baseline.flops,
        fits=False,
        plan=None,
        peak_bytes=None if lowest is None else lowest.peak,
        recomputed_flops=None if lowest is None else lowest.flops,
        allocated_peak_bytes=None if lowest is None else lowest.allocated,
        baseline_allocated_bytes=search.baseline.peak.peak_bytes,
        what=None,
        code=None,
        reason=reason,
        replays=search.replays,
        basis=search.basis,
    )
