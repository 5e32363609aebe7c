"""Applying one :data:`~lightning_vram.records.StepChange` to a replay's fake copy of the module.

Checkpointing runs an ``nn.Sequential``'s segments as ``checkpoint_sequential`` splits them, as the advice's snippet
does; otherwise each unit runs in non-reentrant ``torch.utils.checkpoint.checkpoint`` wherever its parent calls it,
the module itself called (hooks and all) as the advice's ``Checkpointed(block)`` calls it. Both checkpoint through
:func:`~lightning_vram.prediction.replay.buffer_copies.checkpoint_keeping_buffers`, as the printed code does (the
recomputation runs on copies of the units' buffers, counted). A unit of
several consecutive children is run whole, under one checkpoint, at its first child's call; the parent's following
calls of the others then pass their input through once (the plan's units are children the parent calls one after
the other). A plan with a ``switch`` (a transformers model's own call) makes that call on the copy, as the advice
prints it: ``use_cache`` off in its config, then ``activation_checkpointing_enable`` with non-reentrant
checkpointing. Inplace sets the modules' ``inplace`` flag. Only the replay's copy
changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

from torch import nn

from lightning_vram.prediction.replay.buffer_copies import checkpoint_keeping_buffers, checkpoint_saving_matmuls
from lightning_vram.prediction.replay.unit_calls import (
    Call,
    PlanChangesModelError,
    call_of,
    changed_state,
    own_generator,
    python_state,
)
from lightning_vram.records import CheckpointChange, CheckpointPlan, InplaceChange, StepChange


def _submodule(module: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return module.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{what} names a module the model does not have: {name!r}") from None


class _CheckpointedCall(nn.Module):
    """Stands where a unit's first module was and calls it through non-reentrant checkpointing, as user code does.

    ``checkpoint(first, x)`` calls the module itself (with its hooks), in forward and again when backward recomputes
    it, so the replay sees the recomputation as the monitor sees it in a real run. The unit's other modules stay
    where their parent has them; they run inside the checkpoint and pass their input through once afterwards.
    Counting names the module by the user's path, not through this stand-in
    (:data:`~lightning_vram.measure.module_names.STANDS_FOR`).
    """

    _lightning_vram_stands_for: ClassVar[str] = "first"

    def __init__(
        self,
        first: nn.Module,
        rest: list[nn.Module],
        passing: dict[int, tuple[_Link, Any]],
        selective: bool = False,
        unit: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.unit = unit
        """The unit's modules, by their paths in the model."""
        self.calls: list[Call] = []
        """What the unit received and returned at each forward call (set against the step without the plan)."""
        self.every_call = True
        """Whether every call of the unit's first module runs through this wrapper: not where a shared block's place
        lies inside another unit, whose checkpoint runs the block there (its calls are then some of the module's)."""
        self._forwarding = False
        self._checkpoint = checkpoint_saving_matmuls if selective else checkpoint_keeping_buffers
        self.first = first
        self._rest = list(rest)  # a plain list: their parent keeps them registered
        self._passing = passing

    def __getattr__(self, name: str) -> Any:
        """Attributes of the module it stands for (a parent's forward may read its children's settings)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "first":  # not set yet: nothing to look through
                raise
            return getattr(self.first, name)

    def _unit(self, *args: Any, **kwargs: Any) -> Any:
        """The unit's modules in order; in backward's recomputation, raising where it changes their Python state."""
        modules = list(zip(self.unit, [self.first, *self._rest], strict=False))
        before = None if self._forwarding else python_state(modules)
        try:
            output = self.first(*args, **kwargs)
            for module in self._rest:
                output = module(output)
        finally:  # also where the recomputation stops early, once it has what backward needs
            changed = None if before is None else changed_state(before, python_state(modules))
            if changed is not None:
                raise PlanChangesModelError(f"the checkpointing plan changes what the model computes: {changed}")
        return output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The unit, under ``checkpoint_keeping_buffers(...)`` (``checkpoint_saving_matmuls`` where selective).

        With modules after the first, what the caller gets is a :class:`_Link` to pass to the next module, which passes
        on the next link, the last the unit's output: a caller using a module's output elsewhere too
        (``c = self.conv1(x); x = self.relu(self.bn1(c)) + c``) meets a link where a tensor should be, and the replay
        raises (the plan, which would train another model, is not replayed).
        """
        generator = own_generator(zip(self.unit, [self.first, *self._rest], strict=False))
        if generator is not None:
            raise PlanChangesModelError(
                f"the checkpointing plan changes what the model computes: `{generator}` is a torch.Generator of the"
                " unit's own, which backward's recomputation would draw from again (checkpointing restores only the"
                " global random number generators), and the printed code would train another model"
            )
        self._forwarding = True
        try:
            output = self._checkpoint([self.first, *self._rest], self._unit, *args, **kwargs)
        finally:
            self._forwarding = False
        self.calls.append(call_of(args, kwargs, output))
        if not self._rest:
            return output
        links = [_Link(type(module).__name__) for module in self._rest]
        for module, link, passed in zip(self._rest, links, [*links[1:], output], strict=True):
            self._passing[id(module)] = (link, passed)
        return links[0]


class _Link:
    """What a checkpointed unit of several modules hands its caller for the next module: no tensor (a sentinel)."""

    def __init__(self, next_module: str) -> None:
        self.next_module = next_module

    def __repr__(self) -> str:
        return f"<the input of {self.next_module} in a checkpointed unit>"

    def used(self, *_: object, **__: object) -> NoReturn:
        """Any use but being passed to the next module: the caller does something between the unit's modules."""
        raise ValueError(
            f"the checkpointing plan runs {self.next_module} on the output of the module before it, which its caller"
            " does not pass it (or uses elsewhere too)"
        )

    # Arithmetic says why; any other use fails as a non-tensor would (a TypeError, an AttributeError).
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __matmul__ = used
    __rmatmul__ = __pow__ = __neg__ = __getitem__ = __lt__ = __le__ = __gt__ = __ge__ = used


def _checkpoint_unit(
    root: nn.Module,
    names: tuple[str, ...],
    selective: bool = False,
    shared: bool = False,
    enclosed: frozenset[int] = frozenset(),
) -> None:
    """Run the modules ``names`` (consecutive children of one parent) as one checkpointed unit.

    ``selective``: keeping the outputs of matrix products and attention, recomputing the other ops. ``shared``: a
    block of a layer list run as several layers (:attr:`~lightning_vram.records.CheckpointPlan.shared`): one
    wrapper at every place of the model holding it (two lists sharing it, a list and an attribute), as the printed
    code puts it, but a place held by a module of ``enclosed`` (the ids of every module inside the plan's other
    units): that unit's checkpoint recomputes the block there already, and a wrapper inside it would nest a
    checkpoint (the block recomputed twice in backward).
    """
    modules = [_submodule(root, name, "the checkpointing plan") for name in names]
    passing: dict[int, tuple[_Link, Any]] = {}
    parent_name, _, child = names[0].rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    wrapper = _CheckpointedCall(modules[0], modules[1:], passing, selective, names)
    places = [
        (holder, place)
        for holder in (list(root.modules()) if shared else [])
        for place, held in list(holder._modules.items())
        if held is modules[0]
    ]  # every alias, in the whole model
    outside = [(holder, place) for holder, place in places if id(holder) not in enclosed]
    wrapper.every_call = len(outside) == len(places)
    for holder, place in outside or [(parent, child)]:
        setattr(holder, place, wrapper)
    for module in modules[1:]:
        module.forward = _passing_once(module.forward, module, passing)


def _passing_once(
    forward: Callable[..., Any], module: nn.Module, passing: dict[int, tuple[_Link, Any]]
) -> Callable[..., Any]:
    """``module``'s forward, but on the call after its unit ran it, taking its :class:`_Link` and passing on the next.

    Its input must be that link: the unit ran the modules one after the other on one tensor, and a parent that does
    something else between them (``x = self.bn(self.conv(x) * 2)``) would train another model with the plan; the
    replay raises (the plan is not replayed).
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        waiting = passing.pop(id(module), None)
        if waiting is None:
            return forward(*args, **kwargs)
        link, passed = waiting
        if kwargs or len(args) != 1 or args[0] is not link:
            raise ValueError(
                f"the checkpointing plan runs {type(module).__name__} on the output of the module before it, which"
                " its caller does not pass it (or uses elsewhere too)"
            )
        return passed

    return run


def _run_in_order(modules: list[nn.Module]) -> Callable[[Any], Any]:
    """A function calling ``modules`` one after the other on one input, as an ``nn.Sequential`` segment does."""

    def run(inputs: Any) -> Any:
        for module in modules:
            inputs = module(inputs)
        return inputs

    return run


def _switch_on(module: nn.Module, plan: CheckpointPlan, switch: str) -> None:
    """The advice's two lines on the copy's library model: no key/value cache, its own checkpointing switch."""
    model = _submodule(module, plan.container, "the checkpointing plan")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{plan.container!r} ({type(model).__name__}) has no config: not a transformers model")
    config.use_cache = False
    argument = switch.removesuffix("_enable") + "_kwargs"
    getattr(model, switch)(**{argument: {"use_reentrant": False}})


def apply_checkpoint_plan(module: nn.Module, plan: CheckpointPlan) -> None:
    """Checkpoint ``plan``'s units in ``module`` (a replay's copy).

    A plan with a ``switch`` calls it on its container (a transformers model). A plan with ``sequential_segments``
    runs its container, an ``nn.Sequential``, in the plan's segments; otherwise each unit is
    checkpointed where its parent calls it.
    """
    if plan.switch is not None:
        _switch_on(module, plan, plan.switch)
        return
    container = _submodule(module, plan.container, "the checkpointing plan")
    segments = plan.sequential_segments
    if segments is not None:
        if not isinstance(container, nn.Sequential):
            raise ValueError(f"segments need an nn.Sequential; {plan.container!r} is a {type(container).__name__}")
        children = list(container.children())
        size = len(children) // segments
        bounds = [(start, start + size) for start in range(0, size * (segments - 1), size)]

        def run_segments(inputs: Any) -> Any:
            for start, end in bounds:
                inputs = checkpoint_keeping_buffers(children[start:end], _run_in_order(children[start:end]), inputs)
            return _run_in_order(children[bounds[-1][1] :])(inputs)

        container.forward = run_segments  # type: ignore[method-assign]
        return
    firsts = {unit: _submodule(module, unit[0], "the checkpointing plan") for unit in plan.units}
    for unit in plan.units:
        shared = unit[0] in plan.shared
        others = [first for other, first in firsts.items() if other != unit] if shared else []
        enclosed = frozenset(id(inner) for first in others for inner in first.modules())
        _checkpoint_unit(module, unit, unit[0] in plan.selective, shared, enclosed)


def checkpointed_calls(module: nn.Module) -> list[tuple[tuple[str, ...], list[Call], bool]]:
    """Each checkpointed unit in ``module`` (a replay's copy, its plan applied), its calls, and whether they are all.

    All: every call of the unit's first module (:attr:`_CheckpointedCall.every_call`).
    """
    return [
        (child.unit, child.calls, child.every_call)
        for child in module.modules()
        if isinstance(child, _CheckpointedCall)
    ]


def release_plan(module: nn.Module) -> None:
    """Empty what each checkpointed unit in ``module`` (a replay's copy) kept of the replay: its calls, its links.

    Each call's output is a fake tensor whose graph reaches the copy through autograd's C++, a cycle the garbage
    collector cannot see. The replay's containment used to empty them as it put back what the copy's modules held;
    since the plan's stand-ins are the library's, out of that walk, the replay empties them itself (a ResNet's
    checkpointing plans left 218 fake tensors held, and the escape check turned replays off for the run).
    """
    for child in module.modules():
        if isinstance(child, _CheckpointedCall):
            child.calls.clear()
            child._passing.clear()


def apply_inplace(module: nn.Module, names: tuple[str, ...]) -> None:
    """Set ``inplace=True`` on each named module (a replay's copy); each must have the flag."""
    for name in names:
        target = _submodule(module, name, "the inplace change")
        if not isinstance(getattr(target, "inplace", None), bool):
            raise ValueError(f"{name!r} ({type(target).__name__}) has no inplace flag")
        target.inplace = True  # type: ignore[assignment]  # nn.Module annotates attributes as tensors or modules


def change_module(module: nn.Module, change: StepChange | None) -> None:
    """Apply the module side of ``change`` (checkpointing, inplace); other changes leave the module as it is."""
    if isinstance(change, CheckpointChange):
        apply_checkpoint_plan(module, change.plan)
    elif isinstance(change, InplaceChange):
        apply_inplace(module, change.modules)
