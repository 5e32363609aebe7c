"""What each checkpointed unit receives and returns, call by call, set against the step without checkpointing.

A plan checkpoints a unit by putting a wrapper where its first module was, as the advice's ``Checkpointed`` does.
A caller that tells its children apart by class (guided-diffusion's ``TimestepEmbedSequential`` passes the timestep
embedding only to children that are ``isinstance(layer, TimestepBlock)``) calls the wrapper with other arguments than
the module, and the printed code would train another model. The replay without a change records what every module
receives and returns per forward call (the structure of its arguments and results, each tensor's shape and dtype,
each other value's type); a plan's replay records the same at each unit's wrapper, and any difference rules the plan
out (:func:`changed_unit`). A unit whose forward changes Python state on its modules (a call counter) or draws from a
``torch.Generator`` of its own would do it again when backward recomputes it (torch's checkpoint restores only the
global RNG states): :func:`own_generator` and :func:`python_state` tell, and the plan is ruled out with
:class:`PlanChangesModelError`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

Signature = tuple[str, tuple[object, ...]]
"""A value's pytree structure and its leaves: ``(shape, dtype)`` for a tensor, the type's name for anything else."""

Call = tuple[Signature, Signature]
"""One forward call: what the module received (positional and keyword arguments) and what it returned."""


def signature(value: Any) -> Signature:
    """``value``'s structure, each tensor's shape and dtype and each other leaf's type (no values: tensors are fake).

    >>> import torch
    >>> signature(((torch.zeros(2, 3),), {"emb": None}))[1]
    (((2, 3), torch.float32), 'NoneType')
    """
    leaves, spec = tree_flatten(value)
    return str(spec), tuple(
        (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, Tensor) else type(leaf).__name__ for leaf in leaves
    )


def call_of(args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any) -> Call:
    """The :data:`Call` of a forward given ``args`` and ``kwargs`` that returned ``output``."""
    return signature((args, dict(kwargs))), signature(output)


class CallRecorder:
    """Records every forward call of each module of ``root`` (a replay's fake copy), by each name it has there."""

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._calls: dict[int, list[Call]] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> CallRecorder:
        for module in self._root.modules():
            if isinstance(module, torch.jit.ScriptModule):  # takes no hooks: its calls are not recorded
                continue
            calls = self._calls.setdefault(id(module), [])

            def record(
                _module: nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                output: Any,
                calls: list[Call] = calls,
            ) -> None:
                calls.append(call_of(args, kwargs, output))

            self._handles.append(module.register_forward_hook(record, with_kwargs=True))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def by_name(self) -> dict[str, tuple[Call, ...]]:
        """The calls recorded, by every path of each module (a shared module's calls under each of its names).

        A module whose calls were not recorded (a ``ScriptModule``) is left out.
        """
        return {
            name: tuple(self._calls[id(module)])
            for name, module in self._root.named_modules(remove_duplicate=False)
            if id(module) in self._calls
        }


def changed_unit(
    baseline: Mapping[str, Sequence[Call]], units: Iterable[tuple[tuple[str, ...], Sequence[Call], bool]]
) -> str | None:
    """Why a plan's units are not called as the step without checkpointing calls their modules; ``None`` where they are.

    ``baseline``: the calls of each module without the plan (:meth:`CallRecorder.by_name`); ``units``: each unit's
    modules, its wrapper's calls, and whether those are every call of its first module. A unit must be called as
    often as its first module was (where it has every call; else its calls are some of the module's, in order), with
    what that module received each time, and return what its last module returned; a unit whose first or last
    module's calls were not recorded (a ``ScriptModule``) is not checked.
    """
    for names, calls, every_call in units:
        if names[0] not in baseline or names[-1] not in baseline:
            continue
        first = baseline.get(names[0], ())
        last = baseline.get(names[-1], ())
        unit = f"`{names[0]}`" if len(names) == 1 else f"the unit `{names[0]}` to `{names[-1]}`"
        if not every_call:
            first = _matched_in_order(calls, first)
        if len(calls) != len(first):
            return (
                f"its caller calls {unit} {len(calls)} time(s) with the plan, {len(first)} time(s) without: the printed"
                " code would train another model"
            )
        for index, ((received, returned), (expected, _)) in enumerate(zip(calls, first, strict=True)):
            if received != expected:
                return (
                    f"its caller gives {unit} other arguments with the plan (call {index + 1}: {_spoken(received)};"
                    f" without it: {_spoken(expected)}); a caller that tells modules apart by class (isinstance) calls"
                    " the wrapper otherwise than the module, and the printed code would train another model"
                )
            if returned not in {output for _, output in last}:
                return (
                    f"{unit} returns otherwise with the plan (call {index + 1}: {_spoken(returned)}): the printed code"
                    " would train another model"
                )
    return None


def _matched_in_order(calls: Sequence[Call], first: Sequence[Call]) -> list[Call]:
    """Of ``first`` (a module's calls without the plan), those ``calls`` (some of them, in order) match.

    Matched by what each received, at its earliest; fewer than ``calls`` where one matches none.
    """
    matched: list[Call] = []
    remaining = iter(first)
    for received, _ in calls:
        found = next((call for call in remaining if call[0] == received), None)
        if found is None:
            break
        matched.append(found)
    return matched


class PlanChangesModelError(ValueError):
    """A checkpointing plan's replay found that the printed code would train another model (the message says why)."""


PythonState = dict[tuple[str, str], object]
"""What a forward can change on the modules, by module path and attribute name: the plain values (numbers, strings,
``None``) of their attributes, the size of their containers (a list a forward appends to, a dict's plain entries),
and which tensor each parameter is and how often it was changed in place (its version)."""

_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""The attributes every module has (its parameters, buffers, children and hooks): torch's, not the user's state."""


def _plain(value: object) -> bool:
    return value is None or isinstance(value, int | float | str)


def _container(value: object) -> object | None:
    """What a forward that adds to or changes the plain entries of ``value`` changes; ``None``: not a container.

    >>> _container([1, 2]), _container({"calls": 3, "map": []}), _container("text") is None
    (('list', 2), ('dict', 2, (('calls', 3),)), True)
    """
    if isinstance(value, list | tuple | set | frozenset | deque):
        return type(value).__name__, len(value)
    if isinstance(value, dict):
        entries = tuple((key, item) for key, item in value.items() if _plain(key) and _plain(item))
        return type(value).__name__, len(value), entries
    return None


def python_state(modules: Iterable[tuple[str, nn.Module]]) -> PythonState:
    """What a forward can change on ``modules`` (path, module) and their submodules (:data:`PythonState`).

    A frozen parameter a forward updates in place (an exponential moving average kept as a parameter) is changed
    again by backward's recomputation; checkpointing keeps copies of buffers only.
    """
    state: PythonState = {}
    for path, owner in modules:
        for name, module in owner.named_modules(prefix=path):
            for attribute, value in vars(module).items():
                if _plain(value):
                    state[name, attribute] = value
                elif attribute not in _MODULE_INTERNALS:
                    container = _container(value)
                    if container is not None:
                        state[name, attribute] = container
            for attribute, parameter in module.named_parameters(recurse=False):
                state[name, attribute] = ("parameter", id(parameter), parameter._version)
    return state


def changed_state(before: PythonState, after: PythonState) -> str | None:
    """Which attribute a recomputation changed, in words; ``None`` where none."""
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) != after.get(key):
            how = _change_text(before.get(key), after.get(key))
            return (
                f"`{key[0]}.{key[1]}` changes each time its forward runs ({how}):"
                " backward's recomputation would change it again, and the printed code would train another model"
            )
    return None


def _change_text(before: object, after: object) -> str:
    """How an entry of :data:`PythonState` changed, in words.

    >>> _change_text(("parameter", 1, 0), ("parameter", 1, 2)), _change_text(("list", 1), ("list", 2))
    ('a parameter changed in place', 'a list of 1 to 2 items')
    >>> _change_text(3, 4)
    '3 to 4'
    """
    if isinstance(before, tuple) and isinstance(after, tuple) and before[:1] == after[:1]:
        if before[0] == "parameter":
            return "a parameter changed in place" if before[1] == after[1] else "a parameter replaced"
        if before[1:2] != after[1:2]:
            return f"a {before[0]} of {before[1]} to {after[1]} items"
        return f"an entry of a {before[0]} changed"
    return f"{before!r} to {after!r}"


def own_generator(modules: Iterable[tuple[str, nn.Module]]) -> str | None:
    """The path of a ``torch.Generator`` the modules hold (their own random numbers), else ``None``."""
    for path, owner in modules:
        for name, module in owner.named_modules(prefix=path):
            for attribute, value in vars(module).items():
                if isinstance(value, torch.Generator):
                    return f"{name}.{attribute}"
    return None


def _spoken(value: Signature) -> str:
    """A signature in words: its leaves, each tensor as ``shape dtype``."""
    leaves = [
        f"{list(leaf[0])} {str(leaf[1]).removeprefix('torch.')}" if isinstance(leaf, tuple) else str(leaf)
        for leaf in value[1]
    ]
    return ", ".join(leaves) or "nothing"
