"""torch's process-wide hook registries, the one place that names them (private module attributes).

``torch.nn.modules.module`` keeps the hooks of ``register_module_forward_hook`` and its siblings in module-level
dicts, and ``torch.optim.optimizer`` those of ``register_optimizer_step_pre_hook`` / ``_post_hook``. They have had
these names since torch 2.0; a registry a future torch renames is simply not found (an empty tuple), never an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

_REGISTRIES = (
    (module_hooks, "_global_forward_pre_hooks"),
    (module_hooks, "_global_forward_hooks"),
    (module_hooks, "_global_backward_pre_hooks"),
    (module_hooks, "_global_backward_hooks"),
    (module_hooks, "_global_module_registration_hooks"),
    (module_hooks, "_global_parameter_registration_hooks"),
    (module_hooks, "_global_buffer_registration_hooks"),
    (optimizer_hooks, "_global_optimizer_pre_hooks"),
    (optimizer_hooks, "_global_optimizer_post_hooks"),
)


def global_hooks() -> Iterator[tuple[str, Any]]:
    """Every process-wide module and optimizer hook registered now, as ``(registry name, hook)``."""
    for owner, name in _REGISTRIES:
        registry = getattr(owner, name, None)
        if isinstance(registry, dict):
            for hook in list(registry.values()):
                yield name.lstrip("_"), hook


def global_registries() -> tuple[dict[Any, Any], ...]:
    """The process-wide hook registries themselves (ordered dicts): what a replay saves and puts back."""
    found = (getattr(owner, name, None) for owner, name in _REGISTRIES)
    return tuple(registry for registry in found if isinstance(registry, dict))


def module_hooks_of(attributes: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The hooks in a module's ``__dict__`` (its ``_forward_hooks`` and the other ``*_hooks`` dicts)."""
    for name, registry in attributes.items():
        if name.endswith("_hooks") and isinstance(registry, dict):
            for hook in list(registry.values()):
                yield name.lstrip("_"), hook
