"""A replay's warm-up step made without its forward and backward, where an earlier full one showed what it leaves.

A replay of a module that has not trained yet first runs one uncounted step (``Predictor(warm_up=True)``), so that the
gradients and the optimizer state exist as in a steady step: about 40% of the replay's time, spent on a forward and
a backward whose only lasting products are the gradients. Where a full warm-up of the same module at the same
precision has run (a plan's first replay), a later replay can make the same state by arithmetic: a zero gradient,
laid out as the parameter, on each parameter the full warm-up left one on, then the optimizers' own ``step`` (the
state they make is their own code's, as in the full step). It is used only when the state it leaves is the full
warm-up's, tensor by tensor (:func:`signature`: each gradient's and optimizer state entry's shape, strides, dtype,
device, offset and storage bytes, which storages they share, the buffers and every tensor a submodule holds as an
attribute, such as a cache its forward made); otherwise the replay runs again with the full warm-up. A step that
changed the Python state a step may branch on (:func:`step_state`: a counter, a list it appends to, a parameter
it unfreezes) is always warmed up in full: the arithmetic cannot make that change. The replays'
figures are the same either way: the counted step starts from the same tensors.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_vram.measure.storages import storage_identity
from lightning_vram.measure.tensors import iter_tensors
from lightning_vram.prediction.replay.twin import Twin

MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules"})
"""A module's own registries, read as parameters, buffers and submodules rather than as attributes."""

SCALARS = (bool, int, float, str, type(None))
"""Attribute values read as they are (a counter, a flag): compared before and after the full warm-up."""

SIZED = (list, tuple, dict, set, collections.deque)
"""Attribute values read by their length (a list the step appends to): compared before and after the full warm-up."""


@dataclass(frozen=True)
class WarmStart:
    """What a full warm-up left: the parameters with a gradient (by position in ``parameters()``), and the state.

    ``moved``: the entries of :func:`step_state` the full warm-up's step changed; where there is one, no warm-up is
    made by arithmetic.
    """

    graded: frozenset[int]
    signature: tuple[Any, ...]
    moved: frozenset[tuple[str, str]] = frozenset()


class WarmMismatchError(Exception):
    """The arithmetic warm-up left other tensors than the full one: the replay runs again with the full warm-up."""


def step_state(twin: Twin) -> dict[tuple[str, str], str]:
    """The Python state a step may branch on, keyed (module name, attribute) or (parameter position, ``requires_grad``).

    Each submodule's attributes holding a number, string, flag or ``None`` (their repr), those holding a list, tuple,
    dict, set or deque (their length), and whether each parameter requires a gradient.
    """
    state = {
        (name, key): repr(value) if isinstance(value, SCALARS) else f"len {len(value)}"
        for name, child in twin.module.named_modules()
        for key, value in vars(child).items()
        if isinstance(value, SCALARS + SIZED)
    }
    for index, parameter in enumerate(twin.module.parameters()):
        state[(str(index), "requires_grad")] = repr(parameter.requires_grad)
    return state


def recorded(twin: Twin, before: dict[tuple[str, str], str]) -> WarmStart:
    """What the full warm-up just run on ``twin`` left (:class:`WarmStart`); ``before``: :func:`step_state` first."""
    parameters = list(twin.module.parameters())
    graded = frozenset(index for index, parameter in enumerate(parameters) if parameter.grad is not None)
    after = step_state(twin)
    moved = frozenset(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    return WarmStart(graded, signature(twin), moved)


def arithmetic_warm_up(twin: Twin, start: WarmStart) -> None:
    """The warm-up's state made on ``twin`` without forward and backward; :class:`WarmMismatchError` where it differs.

    Call under the replay's fake mode.
    """
    if start.moved:
        raise WarmMismatchError(f"the full warm-up's step changed {sorted(start.moved)[0]}: the arithmetic cannot")
    for index, parameter in enumerate(twin.module.parameters()):
        if index in start.graded:
            parameter.grad = torch.zeros_like(parameter)
    for optimizer in twin.optimizers:
        optimizer.step()
    if signature(twin) != start.signature:
        raise WarmMismatchError("the arithmetic warm-up left other tensors than the full one")


def signature(twin: Twin) -> tuple[Any, ...]:
    """The tensors a step starts from, each described with the storages it shares (numbered as first met).

    Gradients and optimizer state by parameter position, buffers and tensors held as attributes by name.
    """
    storages: dict[int, int] = {}

    def described(tensor: Tensor) -> tuple[Any, ...]:
        storage = tensor.untyped_storage()
        number = storages.setdefault(storage_identity(storage), len(storages))
        return (
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor.device,
            tensor.storage_offset(),
            storage.nbytes(),
            number,
        )

    module = twin.module
    parameters = list(module.parameters())
    positions = {id(parameter): index for index, parameter in enumerate(parameters)}
    grads = tuple(None if p.grad is None else described(p.grad) for p in parameters)
    state = []
    for optimizer in twin.optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                entries = optimizer.state.get(parameter, {})
                state.append(
                    (
                        positions.get(id(parameter)),
                        tuple(
                            (key, described(value) if isinstance(value, Tensor) else type(value).__name__)
                            for key, value in sorted(entries.items(), key=lambda item: str(item[0]))
                        ),
                    )
                )
    buffers = tuple((name, described(buffer)) for name, buffer in module.named_buffers())
    held = tuple(
        (name, key, tuple(described(tensor) for tensor in iter_tensors(value)))
        for name, child in module.named_modules()
        for key, value in vars(child).items()
        if key not in MODULE_SLOTS and any(True for _ in iter_tensors(value))
    )
    return grads, tuple(state), buffers, held
