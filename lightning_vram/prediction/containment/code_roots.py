"""Where a replay's walk starts: the code a replay runs, and what the replay's copy of the module holds."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_vram.measure.compiled import is_compiled_module
from lightning_vram.measure.module_names import user_named_modules
from lightning_vram.measure.storages import gradient_of
from lightning_vram.prediction.containment._torch_hooks import global_hooks, global_registries, module_hooks_of
from lightning_vram.prediction.containment.construction import Copied


def inside_ids(module: nn.Module) -> set[int]:
    """The ids of ``module``'s own objects: itself, its submodules, parameters, buffers and their ``.grad``.

    A buffer the step filled with a tensor computed from the weights is not a leaf: its ``.grad`` is not read (torch
    warns on it, out of the user's run), and it has none.
    """
    ids = {id(child) for child in module.modules()}
    for tensor in (*module.parameters(), *module.buffers()):
        ids.add(id(tensor))
        gradient = gradient_of(tensor)
        if gradient is not None:
            ids.add(id(gradient))
    return ids


@dataclass(frozen=True)
class Remapped:
    """A method bound to the module's own object: the copy the replay runs rebinds it to the copy's object."""

    function: Any


def _root(value: Any, inside: set[int]) -> Any:
    if isinstance(value, types.MethodType) and id(value.__self__) in inside:
        return Remapped(value.__func__)
    return value


def code_roots(
    module: nn.Module,
    step_function: Callable[..., Any] | None,
    optimizers: Iterable[Any] = (),
    batch: Any = None,
) -> list[tuple[str, Any]]:
    """Where the code a replay runs starts, before any copy exists.

    Each submodule's class, its parameters' and buffers' classes, torch's process-wide module and optimizer hooks,
    the step function, the optimizers' classes and the batch's class; of each class, the walk takes the methods the
    step may call by name (:mod:`~.method_reach`). A submodule's class is :class:`~.construction.Copied`: the replay
    deep-copies the module, never constructs it; its copy constructs each parameter of a ``Parameter`` subclass
    (``Parameter.__deepcopy__`` calls ``type(self)(data, requires_grad)``: a ``__new__`` counting its instances counts
    the copy's), it constructs the optimizers (``type(optimizer)(...)``), and Lightning's transfer may rebuild the
    batch. What the module's instances hold (hooks, callables, data) is walked on the copy:
    :func:`instance_roots`.
    """
    roots: list[tuple[str, Any]] = []
    classes: set[type] = set()
    for child in module.modules():
        if type(child) not in classes:
            classes.add(type(child))
            roots.append((type(child).__qualname__, Copied(type(child))))
    tensor_classes = dict.fromkeys(type(tensor) for tensor in (*module.parameters(), *module.buffers()))
    roots += [
        (f"{cls.__qualname__} (a parameter's or buffer's class)", cls)
        for cls in tensor_classes
        if cls not in (Tensor, nn.Parameter)
    ]
    roots += [(f"torch's {kind}", hook) for kind, hook in global_hooks()]
    if step_function is not None:
        roots.append(("step_function", step_function))
    roots += [(type(optimizer).__qualname__, type(optimizer)) for optimizer in optimizers]
    if batch is not None and not isinstance(batch, (Tensor, list, tuple, dict)):
        roots.append(("the batch's class", type(batch)))
    return roots


def hook_registries() -> tuple[dict[Any, Any], ...]:
    """The process-wide module and optimizer hook registries, which a replay saves and puts back.

    A step that registers a global hook registers it again when replayed.
    """
    return global_registries()


def instance_roots(module: nn.Module) -> list[tuple[str, Any]]:
    """The hooks and callables each submodule of ``module`` (the replay's copy) holds as instance attributes.

    A method bound to one of the copy's own objects is its code only; anything else the copy shares with the
    user's module (a function closing over the real one) is reached through it. A compiled module's own attributes
    (its compiled ``forward``) are torch's wrapper's: the module it runs is walked as its ``_orig_mod``. A replay's
    stand-in (a checkpointing plan's wrapper, :data:`~lightning_vram.measure.module_names.STANDS_FOR`) is the
    library's: its attributes are left out, and the user's module it holds is named by the user's path.
    """
    inside = {id(child) for child in module.modules()}
    roots: list[tuple[str, Any]] = []
    for name, child in user_named_modules(module).items():
        if is_compiled_module(child):
            continue
        label = name or "the model"
        attributes = vars(child)
        for kind, hook in module_hooks_of(attributes):
            roots.append((f"{label}: {kind}", _root(hook, inside)))
        for attribute, value in attributes.items():
            if callable(value) and not isinstance(value, (nn.Module, Tensor, type, dict)):
                roots.append((f"{label}.{attribute}", _root(value, inside)))
    return roots


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_trainer", "_fabric"})

_PARAMETER_MIRRORS = frozenset({"_flat_weights", "_flat_weight_refs"})
"""An ``nn.RNNBase``'s lists of its own parameters (and weak references to them), which torch refreshes itself: on
``_apply``, and on each parameter set through its ``__setattr__`` (FSDP2's sharding and unsharding of the replay's
copy). They follow the module's ``_parameters``, which are the copy's own too."""


def _internal(child: nn.Module, attribute: str) -> bool:
    """Whether ``attribute`` of ``child`` is torch's or Lightning's bookkeeping of the module, not the user's data."""
    if attribute in _MODULE_INTERNALS or attribute.endswith("_hooks"):
        return True
    return isinstance(child, nn.RNNBase) and attribute in _PARAMETER_MIRRORS


def data_roots(module: nn.Module) -> list[tuple[str, Any]]:
    """The attributes of ``module`` (the replay's copy) that are neither tensors nor submodules.

    ``deepcopy`` copied most of them; what it shares (classes, weak references' targets, an object whose
    ``__deepcopy__`` returns itself) is the user's. A compiled module's own are torch's wrapper's, and a replay's
    stand-in's the library's, as in :func:`instance_roots`; torch's bookkeeping of the module's own tensors is no
    data of the user's (:func:`_internal`).
    """
    return [
        (f"{name or 'the model'}.{attribute}", value)
        for name, child in user_named_modules(module).items()
        for attribute, value in vars(child).items()
        if not is_compiled_module(child)
        and not _internal(child, attribute)
        and not isinstance(value, (Tensor, nn.Module))
    ]
