"""Applying one :data:`~lightning_vram.records.StepChange` to a replay's fake copy of the module.

Checkpointing runs an ``nn.Sequential`` through ``checkpoint_sequential`` in the plan's number of segments, as the
advice's snippet does; otherwise each unit runs in non-reentrant ``torch.utils.checkpoint.checkpoint`` wherever its
parent calls it. A unit of several consecutive children is run whole, under one checkpoint, at its first child's
call; the parent's following calls of the others then pass their input through once (the plan's units are
children the parent calls one after the other). Inplace sets the modules' ``inplace`` flag. Only the replay's copy
changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from lightning_vram.records import CheckpointChange, CheckpointPlan, InplaceChange, StepChange


def _submodule(module: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return module.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{what} names a module the model does not have: {name!r}") from None


def _checkpoint_unit(modules: list[nn.Module]) -> None:
    """Run ``modules`` (consecutive children) as one checkpointed unit at the first one's call."""
    first, rest = modules[0], modules[1:]
    forward = first.forward
    passing: dict[int, bool] = {}

    def run_unit(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        for module in rest:
            output = module(output)
        return output

    def run(*args: Any, **kwargs: Any) -> Any:
        output = checkpoint(run_unit, *args, use_reentrant=False, **kwargs)
        passing.update(dict.fromkeys(map(id, rest), True))
        return output

    first.forward = run
    for module in rest:
        module.forward = _passing_once(module.forward, module, passing)


def _passing_once(forward: Callable[..., Any], module: nn.Module, passing: dict[int, bool]) -> Callable[..., Any]:
    """``module``'s forward, but returning its input as it is on the call after its unit ran it."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if passing.pop(id(module), False):
            return args[0]
        return forward(*args, **kwargs)

    return run


def apply_checkpoint_plan(module: nn.Module, plan: CheckpointPlan) -> None:
    """Checkpoint ``plan``'s units in ``module`` (a replay's copy).

    A plan with ``sequential_segments`` runs its container, an ``nn.Sequential``, through ``checkpoint_sequential``;
    otherwise each unit is checkpointed where its parent calls it.
    """
    container = _submodule(module, plan.container, "the checkpointing plan")
    segments = plan.sequential_segments
    if segments is not None:
        if not isinstance(container, nn.Sequential):
            raise ValueError(f"segments need an nn.Sequential; {plan.container!r} is a {type(container).__name__}")
        children = list(container.children())

        def run_segments(inputs: Any) -> Any:
            # torch ships checkpoint_sequential without annotations.
            return checkpoint_sequential(children, segments, inputs, use_reentrant=False)  # type: ignore[no-untyped-call]

        container.forward = run_segments  # type: ignore[method-assign]
        return
    for unit in plan.units:
        _checkpoint_unit([_submodule(module, name, "the checkpointing plan") for name in unit])


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
