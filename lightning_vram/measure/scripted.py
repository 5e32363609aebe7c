"""TorchScript modules (``torch.jit.script``) inside a model: counted as one unit each.

A scripted module's class refuses Python hooks (``register_forward_pre_hook`` raises "not supported on
ScriptModules"), and inside TorchScript no Python hook runs. When Python calls a scripted module (its parent is a
Python module), ``nn.Module.__call__`` still runs the hooks in the module's own hook dicts: the monitor registers
its hooks there through ``nn.Module``'s methods, so the module is entered and left like any other, and what it
saves for backward is charged to it as a whole. Its submodules run inside TorchScript and are not hooked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.jit._trace import TracedModule
from torch.utils.hooks import RemovableHandle

from lightning_vram.measure.tallies import ROOT_MODULE
from lightning_vram.records import NotMeasured
from lightning_vram.units import format_bytes


def is_scripted(module: nn.Module) -> bool:
    """Whether ``module`` is a TorchScript module (``torch.jit.script`` of a module, or a loaded one)."""
    return isinstance(module, torch.jit.ScriptModule)


def scripted_module_names(named: dict[str, nn.Module]) -> tuple[str, ...]:
    """The names in ``named`` (a ``named_modules`` dict) of the scripted modules, outermost only."""
    names: list[str] = []
    for name, module in named.items():
        if is_scripted(module) and not any(name.startswith(f"{outer}.") for outer in names):
            names.append(name)
    return tuple(names)


def hook_forward(
    module: nn.Module,
    enter: Callable[[nn.Module, Any], None],
    leave: Callable[[nn.Module, Any, Any], None],
) -> list[RemovableHandle]:
    """Register ``enter`` as a forward pre-hook and ``leave`` as an always-called forward hook of ``module``.

    Through ``nn.Module``'s own methods, which a scripted module's class overrides to refuse: its hook dicts are
    the Python module's, and its Python ``__call__`` runs them.
    """
    return [
        nn.Module.register_forward_pre_hook(module, enter),
        nn.Module.register_forward_hook(module, leave, always_call=True),
    ]


def scripted_note(names: tuple[str, ...]) -> NotMeasured:
    """What the report says of the scripted modules ``names``: counted, each as one unit."""
    listed = ", ".join(name if name != ROOT_MODULE else "the model" for name in names)
    return NotMeasured(
        "per-module activations inside TorchScript modules",
        f"{listed} {'is a torch.jit.script module' if len(names) == 1 else 'are torch.jit.script modules'}: Python"
        " hooks do not run inside TorchScript, so each is counted as one unit (what it saves for backward is charged"
        " to it as a whole; its submodules have no figures of their own)",
    )


SCRIPTED_COPY_BYTES = 64 * 1024**2
"""The most bytes of parameters and buffers in scripted modules a replay copies for real (64 MiB); past it, none."""


def scripted_tensors(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Each parameter and buffer a scripted ``module`` holds, with the scripted module that holds it by name.

    TorchScript modules refuse ``get_submodule``: their submodules are reached by attribute.
    """
    found: list[tuple[nn.Module, str, torch.Tensor]] = []
    for kind in ("named_parameters", "named_buffers"):
        for name, tensor in getattr(module, kind)():
            path, _, leaf = name.rpartition(".")
            owner = module
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part)
            found.append((owner, leaf, tensor))
    return found


def scripted_refusal(module: nn.Module) -> str | None:
    """Why ``module``'s scripted submodules keep its step from being replayed; ``None`` when they do not.

    A replay's deep copy of a TorchScript module copies its tensors in C++, for real (fake tensors are put in their
    place right after): past :data:`SCRIPTED_COPY_BYTES` that real copy is not made.
    """
    names = scripted_module_names(dict(module.named_modules()))
    held = sum(
        tensor.nbytes
        for name in names
        for _owner, _leaf, tensor in scripted_tensors(module.get_submodule(name))
        if tensor.device.type != "meta"
    )
    if held <= SCRIPTED_COPY_BYTES:
        return None
    listed = ", ".join(name or "the model" for name in names)
    return (
        f"{listed} {'is a torch.jit.script module' if len(names) == 1 else 'are torch.jit.script modules'} holding"
        f" {format_bytes(held)} of parameters and buffers: TorchScript copies its tensors for real, not as fake"
        f" tensors, and a replay would need that memory again (it copies up to {format_bytes(SCRIPTED_COPY_BYTES)})"
    )


def traced_modules(model: nn.Module) -> list[str]:
    """The paths in ``model`` of the modules ``torch.jit.trace`` made (``""`` for the model itself), outermost first."""
    return [name for name, module in model.named_modules() if isinstance(module, TracedModule)]
