"""Activation checkpointing plans from one sampled step's module profiles, and what each frees at the peak.

A plan checkpoints consecutive children ("units") of one module, in the order they run:

- the children of a called ``nn.Sequential``, in ``checkpoint_sequential``'s segments (``len // segments``
  children each, the last segment not checkpointed, exactly as torch splits them);
- a contiguous range of the children of any other module, each unit through ``checkpoint(unit, x)``, written in
  the forward that calls them: the module itself, or for an ``nn.ModuleList`` (which has no forward) the nearest
  ancestor that was called.

Where a model has several layer stacks (an encoder's and a decoder's ``ModuleList``), one more plan checkpoints
the best plan of each together, so that one round of advice covers them all.

A unit never starts with an inplace op: ``checkpoint`` keeps the unit's input to recompute it, and an op that
overwrites that input makes backward raise "modified by an inplace operation". Such a child (a ResNet stem's
``ReLU(inplace=True)``) joins the unit before it; ``checkpoint_sequential`` segments cannot move, so a segment
count that would start a checkpointed segment with one is not proposed.

A transformers model that checkpoints its layers itself (a :class:`~lightning_vram.records.CheckpointSwitch`) gets
one plan only, its own call: every layer of every stack (encoder and decoder) in one round, in the user's idiom.

What a plan frees is modelled storage by storage (:func:`plan_peak`): in forward a checkpointed unit keeps only
its input; storages at a unit's boundary stay while a neighbour that is not checkpointed saves them; in backward
each checkpointed unit is recomputed in turn while the earlier units keep what they keep. Units are neighbours only
where no other module ran between them: where one did (a stem, then blocks called through slices of their
``nn.Sequential``, then the pooling), a unit's output goes to that module, which may keep it (a checkpoint keeps its
input), so it stays as the last unit's does, and the next unit's input counts as the first unit's.

Those are activations alone, which rank the plans. What the run's peak falls by, the advice's saving where no plan
was replayed, is bounded from below (:func:`peak_saving`): after the change the peak moves into backward, to the
recomputation of the first, widest units, where every gradient and the gradients flowing through the unit are held,
with backward's temporaries as its live peak held them (what the loss and the modules after the units saved freed).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_vram.records import CheckpointPlan, CheckpointSwitch, ModuleProfile

ROOT = "(root)"
OUTSIDE = "(training_step)"


@dataclass(frozen=True)
class Unit:
    """One checkpointing unit: consecutive children of one module, with what the sampled step saw, in bytes.

    ``saved``: what the unit's modules saved themselves (each storage charged to the first module that saved it).
    ``input_bytes``: its input; ``input_held``: an earlier op held that input already when it ran.
    ``input_saved`` / ``output_saved``: its input / output storages the unit itself saved.
    ``output_bytes``: its output (``0``: not known). ``calls``: how many times it runs for one call of its caller
    (a block shared across the layers, ALBERT's, called in a loop): every figure sums its calls, and a checkpoint of
    it recomputes one call at a time.
    """

    names: tuple[str, ...]
    saved: int
    input_bytes: int
    input_held: bool
    input_saved: int
    output_saved: int
    output_bytes: int = 0
    calls: int = 1

    @property
    def charged_input(self) -> int:
        """Bytes of its input charged to this unit (it saved them first)."""
        return 0 if self.input_held else min(self.input_saved, self.saved)

    @property
    def internal(self) -> int:
        """What it saves besides its input and output."""
        return max(self.saved - self.charged_input - self.output_saved, 0)


class Outside(NamedTuple):
    """Activations saved outside a plan's units, in bytes, by when they ran.

    ``before`` / ``after``: saved before the first unit (and by the enclosing modules) / after the last one (and by
    the training step). ``between[i]``: saved by modules that ran between unit ``i - 1`` and unit ``i``, ``None``
    where none ran (the units are neighbours; always ``None`` for the first unit); empty: every unit a neighbour.
    """

    before: int
    after: int
    between: tuple[int | None, ...] = ()


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def plan_peak(
    units: Sequence[Unit], checkpointed: Sequence[bool], before: int, after: int, between: Sequence[int | None] = ()
) -> int:
    """Highest activation bytes, over forward and backward, with the ``checkpointed`` units checkpointed.

    ``before`` / ``after``: activations saved outside the units before / after them (after ones are freed by
    the time backward reaches the units). ``between``: as :attr:`Outside.between`. A boundary storage between
    neighbouring units ``i - 1`` and ``i`` stays after forward when unit ``i - 1`` is not checkpointed and saved it,
    or unit ``i`` keeps it (as a checkpointed input, or saving it). Where other modules ran between two units, what
    they saved stays until backward has passed them, unit ``i - 1``'s output stays as it was saved (the module after
    it may keep it: a checkpoint keeps its input) and unit ``i``'s input counts as the first unit's. Recomputing
    unit ``i`` holds what the units before it keep, and everything unit ``i`` saves again (its input is the one it
    kept).

    >>> block = Unit(("b",), saved=20, input_bytes=2, input_held=False, input_saved=0, output_saved=0)
    >>> plan_peak([block, block, block], [True, True, False], before=0, after=0)  # 2 + 2 + 20, 60 unchanged
    24
    >>> stem = Unit(("stem",), saved=9, input_bytes=1, input_held=False, input_saved=1, output_saved=4)
    >>> head = Unit(("head",), saved=0, input_bytes=4, input_held=True, input_saved=0, output_saved=0)
    >>> plan_peak([stem, head], [True, False], 0, 0, between=(None, 20))  # 20 between, the stem's input and output
    25
    """
    forward, backward = _moments(units, checkpointed, before, after, between)
    return max([forward, *(held for held, flag in zip(backward, checkpointed, strict=True) if flag)])


def _moments(
    units: Sequence[Unit], checkpointed: Sequence[bool], before: int, after: int, between: Sequence[int | None]
) -> tuple[int, list[int]]:
    """The activation bytes held at the end of forward, and when backward reaches each unit, as :func:`plan_peak`.

    A checkpointed unit's moment is its recomputation's; another's holds what the units before it keep and its own.
    """
    gaps = list(between) or [None] * len(units)
    boundaries = []
    for index, unit in enumerate(units):
        if index == 0 or gaps[index] is not None:
            # The units' input, or one after other modules: outside when an earlier op saved it, else kept here.
            kept = not unit.input_held and (checkpointed[index] or unit.input_saved > 0)
        else:
            kept = (
                (not checkpointed[index - 1] and units[index - 1].output_saved > 0)
                or checkpointed[index]
                or unit.input_saved > 0
            )
        boundaries.append(unit.input_bytes if kept else 0)
    # A unit's output before other modules, and the last unit's: the consumer is not a unit; assume it keeps what
    # was kept before.
    outputs = [
        unit.output_saved if index == len(units) - 1 or gaps[index + 1] is not None else 0
        for index, unit in enumerate(units)
    ]
    forward = before + after + sum(boundaries) + sum(outputs) + sum(gap or 0 for gap in gaps)
    forward += sum(unit.internal for unit, flag in zip(units, checkpointed, strict=True) if not flag)
    moments = []
    held_before = before
    for index, unit in enumerate(units):
        held_before += boundaries[index] + (gaps[index] or 0)
        own = unit.internal + unit.output_saved
        moments.append(held_before + (own // unit.calls if checkpointed[index] else own))
        if not checkpointed[index]:
            held_before += unit.internal
        if outputs[index] and index < len(units) - 1:
            held_before += outputs[index]
    return forward, moments


class Held(NamedTuple):
    """What the sampled step held besides its saved activations, in bytes, as measured.

    ``forward``: the counted parts of the forward phase's peak but its activations (parameters, gradients held from
    the step before, optimizer state); ``forward_other``: the rest of that peak (temporaries, the batch).
    ``backward``: parameters, optimizer state and every gradient (backward ends holding them all);
    ``backward_other``: what the backward phase's peak held beyond its counted parts. ``peak``: the run's peak.
    """

    forward: int
    forward_other: int
    backward: int
    backward_other: int
    peak: int


def peak_saving(units: Sequence[Unit], checkpointed: Sequence[bool], outside: Outside, held: Held) -> int:
    """What the ``checkpointed`` units lower the whole peak by, at most :func:`modelled_saving`: a bound from below.

    The peak moves: after the change it can fall in backward, while a checkpointed unit is recomputed and the
    gradient flows through it, holding gradients and temporaries the step's measured peak (at the end of forward,
    or the start of backward) did not. Each moment counts what ``held`` measured besides activations, and the
    temporaries of the unit it runs, its input's and output's bytes (the gradient flowing in, the gradient
    it makes), or the measured phase's, the larger; in backward every gradient, made or not (conservative).

    Backward's measured ``other`` is its live peak less the counted parts at their own highest, at backward's start,
    which still holds what the loss and the modules after the units saved (``outside.after``: a head's input, the
    log-probabilities). A live peak inside a unit's backward (an attention layer's, holding the scores' gradient)
    comes after backward freed those, so its temporaries were ``other`` and those bytes: a unit's moment in
    backward counts them so (taking ``other`` alone, an eager-attention stack was promised 539,108 bytes more than
    it realised). Backward's start, all that forward kept with ``other``, is a moment too.

    >>> block = Unit(("b",), saved=20, input_bytes=2, input_held=False, input_saved=0, output_saved=0, output_bytes=2)
    >>> held = Held(forward=5, forward_other=0, backward=5, backward_other=1, peak=5 + 60 + 1)
    >>> modelled_saving([block] * 3, [True, True, False], Outside(0, 0))  # 60 saved, 24 at the recomputation
    36
    >>> peak_saving([block] * 3, [True, True, False], Outside(0, 0), held)  # 66 - (5 + 24 + 2 + 2)
    33
    """
    forward, backward = _moments(units, checkpointed, *outside)
    flowing = [(unit.input_bytes + unit.output_bytes) // unit.calls for unit in units]
    run = max((extra for extra, flag in zip(flowing, checkpointed, strict=True) if flag), default=0)
    # The measured backward `other` is the live peak less the counted parts at their own highest, backward's start,
    # which still held what the loss and the modules after the units saved; a live peak inside a unit's backward
    # comes after backward freed those: its temporaries are the measured `other` and those bytes.
    temporaries = held.backward_other + outside.after
    peaks = [held.forward + forward + max(held.forward_other, run), held.backward + forward + held.backward_other]
    peaks += [
        held.backward + held_there + max(temporaries, extra)
        for held_there, extra in zip(backward, flowing, strict=True)
    ]
    return min(modelled_saving(units, checkpointed, outside), held.peak - max(peaks))


def _starts_inplace(name: str, called: dict[str, ModuleProfile], children: dict[str, list[str]]) -> bool:
    """Whether the first op ``name`` runs is an inplace module (itself, or its first child, recursively)."""
    while True:
        if called[name].inplace is True:
            return True
        first_children = children.get(name)
        if not first_children:
            return False
        name = first_children[0]


class ProfileIndex:
    """The sampled step's module profiles, indexed for planning: what each module saved with its submodules.

    ``checkpointed``: modules the step recomputed in backward already (the user's own checkpointing: an applied
    plan's ``Checkpointed`` or ``SelectivelyCheckpointed`` wrapper, torch's ``checkpoint_wrapper``, a ``checkpoint``
    call in a forward), as :attr:`~lightning_vram.records.RunSummary.recomputed_units` names them.
    """

    def __init__(self, profiles: tuple[ModuleProfile, ...], checkpointed: Collection[str] = ()) -> None:
        self.checkpointed = frozenset(checkpointed)
        self.order = {profile.name: index for index, profile in enumerate(profiles)}
        self.called = {profile.name: profile for profile in profiles if profile.name not in (ROOT, OUTSIDE)}
        self.own = {profile.name: profile.activation_bytes for profile in profiles}
        self.calls = {profile.name: profile.calls for profile in profiles}
        self.inclusive = dict.fromkeys(self.called, 0)
        for name, profile in self.called.items():
            while name:
                if name in self.inclusive:
                    self.inclusive[name] += profile.activation_bytes
                name = _parent(name)
        self.children: dict[str, list[str]] = {}
        for name in self.called:
            self.children.setdefault(_parent(name), []).append(name)

    def rechecks(self, names: Sequence[str]) -> bool:
        """Whether a checkpoint of modules ``names`` would nest checkpointing (backward recomputing twice).

        One of them is a module the step recomputed already, is inside one or holds one (an applied plan's wrapper
        holds the module it re-runs). Backward would recompute such a module once for each checkpoint around it.

        >>> ProfileIndex((), ["layers.1.block"]).rechecks(["layers.1"]), ProfileIndex((), ["a"]).rechecks(["b"])
        (True, False)
        """
        return any(_overlaps(name, done) for name in names for done in self.checkpointed)

    def caller(self, name: str) -> str:
        """The nearest called ancestor of ``name`` (``""``: the LightningModule)."""
        parent = _parent(name)
        while parent and parent not in self.called:
            parent = _parent(parent)
        return parent

    def unit(self, names: Sequence[str]) -> Unit:
        """The unit of consecutive modules ``names``: its input is the first's, its output the last's."""
        first, last = self.called[names[0]], self.called[names[-1]]
        caller_calls = self.calls.get(self.caller(names[0]), 1) or 1
        return Unit(
            names=tuple(names),
            saved=sum(self.inclusive[name] for name in names),
            input_bytes=first.input_bytes,
            input_held=first.input_saved_for_backward,
            input_saved=first.input_saved_bytes,
            output_saved=last.output_saved_bytes,
            output_bytes=last.output_bytes,
            calls=max(first.calls // caller_calls, 1) if len(names) == 1 else 1,
        )

    def shared_block(self, names: Sequence[str]) -> bool:
        """Whether ``names`` is one module with submodules that ran more often than its caller: a shared block.

        A block shared across layers (ALBERT's), called in a loop: ``Checkpointed`` in its place checkpoints each of
        its calls, each a whole call of it (its input kept, one call recomputed at a time). A leaf module run twice
        among its siblings (a block's one ReLU) is not one (:meth:`repeated`).
        """
        return len(names) == 1 and self.repeated(names) and bool(self.children.get(names[0]))

    def repeated(self, names: Sequence[str]) -> bool:
        """Whether one of modules ``names`` ran more often than the module calling it.

        A block's one ReLU, called after its first BatchNorm and again after the residual sum: its profile sums calls
        that fall between other modules, so no unit can hold it. A module the training step calls itself is never
        repeated: each of its calls (a GAN's generator for each optimizer, a siamese encoder on each input) is a
        whole forward of its own, which a checkpoint wrapper around it covers.
        """
        return any((caller := self.caller(name)) and self.calls[name] > self.calls.get(caller, 1) for name in names)

    def outside(self, groups: Sequence[Sequence[str]]) -> Outside:
        """Activations saved outside the units ``groups`` (each a unit's modules), by when they ran.

        Modules registered before the first unit, and the enclosing modules' own saves, count as before; those
        registered after the last unit and the training step's own (the loss) as after; those registered between
        two units (not inside either) as between them.
        """
        units = {name for group in groups for name in group}
        starts = [self.order[group[0]] for group in groups]
        before = after = 0
        between: list[int | None] = [None] * len(groups)
        for name, saved in self.own.items():
            enclosing = name
            while enclosing and enclosing not in units:
                enclosing = _parent(enclosing)
            if enclosing:
                continue  # inside a unit
            ancestor = name == ROOT or groups[0][0].startswith(f"{name}.")
            if name != OUTSIDE and (ancestor or self.order[name] < starts[0]):
                before += saved
            elif name == OUTSIDE or self.order[name] > starts[-1]:
                after += saved
            else:
                index = next(index for index, start in enumerate(starts) if self.order[name] < start)
                between[index] = (between[index] or 0) + saved
        return Outside(before, after, tuple(between))


def modelled_saving(units: Sequence[Unit], checkpointed: Sequence[bool], outside: Outside) -> int:
    """The activation bytes the ``checkpointed`` units free at the peak: what was saved less :func:`plan_peak`."""
    plain = outside.before + outside.after + sum(gap or 0 for gap in outside.between) + sum(u.saved for u in units)
    return plain - plan_peak(units, checkpointed, *outside)


def _plan(
    container: str,
    units: list[Unit],
    flags: list[bool],
    outside: Outside,
    segments: int | None,
    forward_of: str,
) -> CheckpointPlan:
    saving = modelled_saving(units, flags, outside)
    chosen = [unit for unit, flag in zip(units, flags, strict=True) if flag]
    names = tuple(unit.names for unit in chosen)
    return CheckpointPlan(container, names, segments, saving, forward_of, shared=shared_units(chosen))


def shared_units(units: Iterable[Unit]) -> tuple[str, ...]:
    """The one-module units of a layer list run as several layers (:attr:`CheckpointPlan.shared`), by name.

    >>> shared_units([Unit(("layers.0",), 0, 0, False, 0, 0, calls=6), Unit(("shared",), 0, 0, False, 0, 0, calls=6)])
    ('layers.0',)
    """
    return tuple(
        unit.names[0]
        for unit in units
        if len(unit.names) == 1 and unit.calls > 1 and unit.names[0].rpartition(".")[2].isdigit()
    )


def _sequential_plans(profiles: ProfileIndex, container: str, names: list[str]) -> list[CheckpointPlan]:
    """``checkpoint_sequential`` with every segment count whose checkpointed segments start without an inplace op."""
    plans: list[CheckpointPlan] = []
    if profiles.repeated(names) or profiles.rechecks(names):
        return plans  # torch's segments cannot leave a child out (see ProfileIndex.repeated, .rechecks)
    for segments in range(2, len(names) + 1):
        groups = _segments(names, segments)
        if any(_starts_inplace(group[0], profiles.called, profiles.children) for group in groups[:-1]):
            continue
        units = [profiles.unit(group) for group in groups]
        if any(unit.saved == 0 for unit in units[:-1]):
            continue  # a checkpointed segment that saves nothing frees nothing and costs a forward
        flags = [True] * (len(units) - 1) + [False]
        outside = profiles.outside(groups)
        plans.append(_plan(container, units, flags, outside, segments, profiles.caller(container)))
    return plans


def _segments(names: list[str], segments: int) -> list[list[str]]:
    """Children ``names`` in ``checkpoint_sequential``'s ``segments``: ``len // segments`` each, the last the rest."""
    size = len(names) // segments
    groups = [names[start : start + size] for start in range(0, size * (segments - 1), size)]
    return [*groups, names[size * (segments - 1) :]]


def unit_groups(profiles: ProfileIndex, names: list[str]) -> list[list[str]]:
    """Consecutive children ``names`` as checkpointing units: a child that starts inplace joins the unit before it.

    The first group may start with an inplace op (it has no unit before it): :func:`starts_inplace` tells. A group
    holding a module that outran its caller (:meth:`ProfileIndex.repeated`) is left out: its modules count
    as run between the units around it, what they saved stays.
    """
    groups: list[list[str]] = []
    for name in names:
        if groups and starts_inplace(profiles, name):
            groups[-1].append(name)
        else:
            groups.append([name])
    return [group for group in groups if not profiles.repeated(group) or profiles.shared_block(group)]


def starts_inplace(profiles: ProfileIndex, name: str) -> bool:
    """Whether the first op module ``name`` runs is an inplace module: it cannot start a checkpointed unit."""
    return _starts_inplace(name, profiles.called, profiles.children)


def _range_plans(profiles: ProfileIndex, container: str, names: list[str]) -> list[CheckpointPlan]:
    """Checkpoint a contiguous range of units that ends at the last unit saving something or the one before it.

    A child that starts with an inplace op joins the unit before it; the first child cannot start a range then.
    A unit that saved nothing in the sampled step (``Flatten``, a global pooling, a ``Dropout`` in eval mode), or
    that holds a module that outran its caller, is never checkpointed: it neither starts nor ends a range, and
    inside one it runs as before. Nor is a unit checkpointed already, inside or around (:meth:`ProfileIndex.rechecks`:
    an applied plan's ``SelectivelyCheckpointed`` layer keeps its selective checkpointing, not wrapped again).
    """
    groups = unit_groups(profiles, names)
    if len(groups) < 2 and not (groups and profiles.shared_block(groups[0])):
        return []  # one unit is a plan of its own only as a shared block (a list holding one block at every place)
    units = [profiles.unit(group) for group in groups]
    forward_of = container if container in profiles.called else profiles.caller(container)
    outside = profiles.outside(groups)
    plans = []
    saving = [index for index, unit in enumerate(units) if unit.saved > 0 and not profiles.rechecks(groups[index])]
    for end in saving[-2:]:
        for start in saving:
            if start > end or _starts_inplace(groups[start][0], profiles.called, profiles.children):
                continue  # the first child runs inplace and has no unit before it to join
            flags = [start <= index <= end and index in saving for index in range(len(units))]
            plans.append(_plan(container, units, flags, outside, None, forward_of))
    return plans


CANDIDATE_PLANS = 3
"""Plans offered to the step replay: the best few by modelled saving, so that one that breaks backward has a
runner-up (and each one's trim, :func:`trimmed`)."""

SAVING_TOLERANCE = 0.02
"""Plans whose saving is within this share of the peak of the best one save nearly as much: the checkpointing
advice gives the cheapest of its replayed plans that do, and a candidate is trimmed of the units it can lose while
its modelled saving stays within this share of the sampled step's saved activations (at most its peak)."""


def recomputed_modules(plan: CheckpointPlan) -> int:
    """How many modules ``plan`` checkpoints, each recomputed in backward: its cost, as the planner ranks ties.

    >>> recomputed_modules(CheckpointPlan("layers", (("layers.0",), ("layers.1", "layers.2")), None, 0))
    3
    """
    return sum(len(unit) for unit in plan.units)


def _ranked_plans(profiles: tuple[ModuleProfile, ...], checkpointed: Collection[str] = ()) -> list[CheckpointPlan]:
    """Every applicable plan that frees something, the largest modelled saving first.

    None checkpoints a module the step recomputed already (``checkpointed``, :meth:`ProfileIndex.rechecks`). Ties go
    to the plan that checkpoints fewer modules (less recomputation), then to the order plans were found.
    """
    indexed = ProfileIndex(profiles, checkpointed)
    plans: list[CheckpointPlan] = []
    for container, names in indexed.children.items():
        if len(names) < 2 and not indexed.shared_block(names):
            continue
        profile = indexed.called.get(container)
        if profile is not None and profile.type == "Sequential" and len(names) > 1:
            plans += _sequential_plans(indexed, container, names)
        else:
            plans += _range_plans(indexed, container, names)
    useful = [
        plan
        for plan in plans
        if plan.saving_bytes > 0
        and not recomputes_scripted(indexed, plan)
        and not any(indexed.rechecks(unit) for unit in plan.units)
    ]
    ranked = sorted(useful, key=lambda plan: (-plan.saving_bytes, recomputed_modules(plan)))
    stacks = _stacks_plan(indexed, ranked)
    if stacks is None or recomputes_scripted(indexed, stacks):
        return ranked
    return sorted([stacks, *ranked], key=lambda plan: (-plan.saving_bytes, recomputed_modules(plan)))


SCRIPTED_TYPES = frozenset({"RecursiveScriptModule", "ScriptModule"})
"""The class names a ``torch.jit.script`` module profiles under."""


def recomputes_scripted(indexed: ProfileIndex, plan: CheckpointPlan) -> bool:
    """Whether ``plan`` checkpoints a TorchScript module or a module holding one: torch's checkpoint fails there.

    Its recomputation in backward raises in the TorchScript interpreter (torch 2.13), for real as on fake tensors.
    """
    scripted = [name for name, profile in indexed.called.items() if profile.type in SCRIPTED_TYPES]
    return any(
        name == member or name.startswith(f"{member}.") for unit in plan.units for member in unit for name in scripted
    )


def is_stack(indexed: ProfileIndex, container: str) -> bool:
    """A container of numbered children that is never called itself: an ``nn.ModuleList`` of layers."""
    names = indexed.children.get(container, [])
    return container not in indexed.called and all(name.rpartition(".")[2].isdigit() for name in names)


def _common_ancestor(names: list[str]) -> str:
    """The deepest module enclosing every one of ``names`` (``""``: the trained module).

    >>> _common_ancestor(["model.encoder.layers", "model.decoder.layers"]), _common_ancestor(["enc", "dec"])
    ('model', '')
    """
    shared: list[str] = []
    for column in zip(*(name.split(".") for name in names), strict=False):  # the shortest name bounds it
        if len(set(column)) > 1:
            break
        shared.append(column[0])
    return ".".join(shared)


def _stacks_plan(indexed: ProfileIndex, ranked: list[CheckpointPlan]) -> CheckpointPlan | None:
    """One plan over several layer stacks (an encoder's and a decoder's): the best plan of each, together.

    Only plans of one-module units (the ``Checkpointed`` wrapper puts each where it is, whoever calls it); ``None``
    with fewer than two stacks.
    """
    best: dict[str, CheckpointPlan] = {}
    for plan in ranked:
        one_module = plan.sequential_segments is None and all(len(unit) == 1 for unit in plan.units)
        if one_module and is_stack(indexed, plan.container):
            best.setdefault(plan.container, plan)
    # A stack inside another's unit (a mixture-of-experts block's `experts` list, inside `blocks.0`): checkpointing
    # both would nest checkpoints (backward recomputing the inner unit twice) and count its activations twice. The
    # outer unit covers it, so a unit inside another stack's unit is left out, and so is a stack left with none.
    every = [unit[0] for plan in best.values() for unit in plan.units]
    kept = {
        container: [unit for unit in plan.units if not any(_inside(unit[0], other) for other in every)]
        for container, plan in best.items()
    }
    best = {container: plan for container, plan in best.items() if kept[container]}
    if len(best) < 2:
        return None
    names = sorted((unit[0] for container in best for unit in kept[container]), key=indexed.order.__getitem__)
    units = [indexed.unit([name]) for name in names]
    saving = modelled_saving(units, [True] * len(units), indexed.outside([[name] for name in names]))
    shared = tuple(name for plan in best.values() for name in plan.shared if name in names)
    return CheckpointPlan(
        _common_ancestor(list(best)),
        tuple((name,) for name in names),
        None,
        saving,
        indexed.caller(names[0]) or None,
        shared=shared,
    )


def switch_plan(profiles: tuple[ModuleProfile, ...], switch: CheckpointSwitch) -> CheckpointPlan | None:
    """The library's own call checkpointing every layer of ``switch``'s model, with its modelled saving.

    ``None`` when none of its layers ran in the sampled forward pass.
    """
    indexed = ProfileIndex(profiles)
    names = sorted((name for name in switch.layers if name in indexed.called), key=indexed.order.__getitem__)
    if not names:
        return None
    units = [indexed.unit([name]) for name in names]
    outside = indexed.outside([[name] for name in names])
    if switch.model:
        # A transformers task model runs its base model's layers, then its head and loss: its own saves come after.
        head = indexed.own.get(switch.model, 0)
        outside = outside._replace(before=outside.before - head, after=outside.after + head)
    saving = modelled_saving(units, [True] * len(units), outside)
    return CheckpointPlan(
        switch.model, tuple((name,) for name in switch.layers), None, saving, switch.model, switch=switch.method
    )


def checkpoint_candidates(
    profiles: tuple[ModuleProfile, ...],
    switches: tuple[CheckpointSwitch, ...] = (),
    limit: int = CANDIDATE_PLANS,
    checkpointed: Collection[str] = (),
) -> list[CheckpointPlan]:
    """Up to ``limit`` applicable plans, the largest modelled saving first, then the best one's trims: what to replay.

    The best plan's trim (:func:`trimmed`) and the best plan without its last unit follow them where they are not
    among them. Where the model has
    ``switches`` (transformers' own call) that are off, only those are offered: the user's idiom. A library model
    that checkpoints its layers already is left alone: no plan checkpoints it, a module in it, or a module holding
    it, again; so is a module the step recomputed already (``checkpointed``: the user's own checkpointing, an applied
    plan's wrappers): checkpointing it again would recompute it twice in backward (:meth:`ProfileIndex.rechecks`).
    A switch covering such a module is not offered either (it would checkpoint every layer, the recomputed ones
    inside their wrappers again, and a selective plan's layers whole): the plans around them are.
    """
    rechecked = ProfileIndex(profiles, checkpointed).rechecks
    own = [
        plan
        for switch in switches
        if not switch.on and not rechecked(switch.layers) and (plan := switch_plan(profiles, switch)) is not None
    ]
    if own:
        return sorted(own, key=lambda plan: (-plan.saving_bytes, recomputed_modules(plan)))[:limit]
    done = [switch.model for switch in switches if switch.on]
    plans = [
        plan
        for plan in _ranked_plans(profiles, checkpointed)
        if not any(_overlaps(unit[0], model) for unit in plan.units for model in done)
    ][:limit]
    indexed = ProfileIndex(profiles, checkpointed)
    # The best plan's trim, and (the model may misjudge the last unit before backward's peak) the best plan without
    # its last unit, for the replay to settle: two replays more at most.
    shorter = [trimmed(indexed, plans[0]), trimmed(indexed, plans[0], last_only=True)] if plans else []
    for trim in shorter:
        if trim is not None and all((trim.container, trim.units) != (other.container, other.units) for other in plans):
            plans.append(trim)
    return plans


def trimmed(indexed: ProfileIndex, plan: CheckpointPlan, last_only: bool = False) -> CheckpointPlan | None:
    """``plan`` without the units it can lose for nearly nothing: a cheaper plan for nearly its modelled saving.

    Every unit dropped is one recomputation fewer. One at a time, the unit whose loss lowers the modelled saving
    least (on a tie the unit of more modules, then the later one) is dropped while the saving stays within
    :data:`SAVING_TOLERANCE` of the sampled step's saved activations below the plan's. Checkpointing the last unit
    that runs before backward's peak frees nothing there (backward recomputes it first, while everything before it
    is still held): a ResNet's last block, or a stem's normalisation whose output the first block keeps anyway.
    ``last_only``: the plan without its last unit, whatever the model says it saves (a trial's ResNet: the model
    gave its last block more than the tolerance, its replay nothing). Only a range plan (:func:`_range_plans`) is
    trimmed; ``None`` where no unit can go.
    """
    if plan.sequential_segments is not None or plan.switch is not None or plan.container not in indexed.children:
        return None
    groups = unit_groups(indexed, indexed.children[plan.container])
    names = [tuple(group) for group in groups]
    if any(unit not in names for unit in plan.units):
        return None  # not a plan of this container's units (several stacks together)
    units = [indexed.unit(group) for group in groups]
    outside = indexed.outside(groups)
    kept = {names.index(unit) for unit in plan.units}
    if last_only:
        if len(kept) < 2:
            return None
        kept.remove(max(kept))
        flags = [index in kept for index in range(len(units))]
        return _plan(plan.container, units, flags, outside, None, plan.forward_of or "")
    tolerance = int(SAVING_TOLERANCE * sum(indexed.own.values()))
    floor = modelled_saving(units, [index in kept for index in range(len(units))], outside) - tolerance
    while len(kept) > 1:
        savings = {
            index: modelled_saving(units, [other in kept and other != index for other in range(len(units))], outside)
            for index in kept
        }
        index = max(kept, key=lambda index: (savings[index], len(names[index]), index))
        if savings[index] < floor:
            break
        kept.remove(index)
    if len(kept) == len(plan.units):
        return None
    flags = [index in kept for index in range(len(units))]
    return _plan(plan.container, units, flags, outside, None, plan.forward_of or "")


def plan_layout(indexed: ProfileIndex, plan: CheckpointPlan) -> tuple[list[Unit], list[bool], Outside]:
    """The units of ``plan``, which of them it checkpoints, and what is saved outside them: as it was modelled.

    A ``checkpoint_sequential`` plan's segments, a range of one module's units, or (several stacks together, a
    library's own call) its checkpointed units alone.
    """
    names = indexed.children.get(plan.container, [])
    grouped = unit_groups(indexed, names)
    if plan.sequential_segments is not None:
        groups = _segments(names, plan.sequential_segments)
        flags = [True] * (len(groups) - 1) + [False]
    elif plan.switch is None and all(list(unit) in grouped for unit in plan.units):
        groups = grouped
        flags = [tuple(group) in plan.units for group in groups]
    else:
        called = [unit for unit in plan.units if unit[0] in indexed.called]
        groups = sorted((list(unit) for unit in called), key=lambda group: indexed.order[group[0]])
        flags = [True] * len(groups)
    outside = indexed.outside(groups)
    if plan.switch is not None and plan.container:
        head = indexed.own.get(plan.container, 0)  # as switch_plan: the task model's own saves come after
        outside = outside._replace(before=outside.before - head, after=outside.after + head)
    return [indexed.unit(group) for group in groups], flags, outside


def checkpointed_peak_saving(
    profiles: tuple[ModuleProfile, ...], plan: CheckpointPlan, held: Held, checkpointed: Collection[str] = ()
) -> int:
    """What ``plan`` lowers the run's peak by, modelled from the sampled step (:func:`peak_saving`), in bytes."""
    return peak_saving(*plan_layout(ProfileIndex(profiles, checkpointed), plan), held)


def _overlaps(name: str, model: str) -> bool:
    """Whether module ``name`` is ``model``, inside it or holds it.

    >>> _overlaps("model.model", "model"), _overlaps("model", "model.model"), _overlaps("head", "model")
    (True, True, False)
    """
    return not model or name == model or name.startswith(f"{model}.") or model.startswith(f"{name}.")


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` is inside module ``outer`` (not ``outer`` itself).

    >>> _inside("blocks.0.moe.experts.1", "blocks.0"), _inside("blocks.0", "blocks.0"), _inside("blocks.10", "blocks.1")
    (True, False, False)
    """
    return name.startswith(f"{outer}.")


def best_checkpoint_plan(profiles: tuple[ModuleProfile, ...]) -> CheckpointPlan | None:
    """The applicable checkpointing plan that frees the most activation bytes at the peak.

    Ties go to the plan that checkpoints fewer modules (less recomputation). ``None`` when no plan frees anything.
    """
    ranked = _ranked_plans(profiles)
    return ranked[0] if ranked else None
