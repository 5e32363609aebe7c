"""A live FSDP2 module as the replay's twin copies it: unsharded, of its original classes, without FSDP's state.

``fully_shard`` turns each parameter of a unit into a DTensor of the whole (global) shape holding this rank's shard,
swaps each unit's class for an ``FSDP<Name>`` subclass (which refuses ``deepcopy``), keeps its state (process groups,
streams, the parameters' shards) under the module's composable-API keys, and registers hooks (forward, state dict)
on the modules. The twin is the module as it was before: each DTensor parameter copied as a plain fake parameter of
its global shape and dtype on this rank's device (:func:`whole_parameter`), each unit an instance of its original
class with the same attributes and submodules, every hook FSDP registered left out, FSDP's state not copied at all.
Nothing of the real module is changed or read beyond its attributes: the shards' values are never read, no
collective runs. A rank's replay shards the twin again its own way
(:mod:`~lightning_vram.prediction.strategies.fsdp2`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from lightning_vram.measure.storages import DTENSOR, FSDP_MODULE
from lightning_vram.prediction.replay._fake import FakeTensorMode

STATE_KEY_PREFIX = "__composable_api_state_key"
"""How the attributes holding a composable API's state and registry start (torch 2.13, ``_composable/contract``)."""
FSDP_CODE = "torch.distributed.fsdp"
"""The package whose functions and methods FSDP2 registers as hooks."""


def fsdp2_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each ``fully_shard`` unit under ``module`` (itself included), with its name (the root's is ``""``)."""
    if FSDP_MODULE is None:
        return []
    kind = FSDP_MODULE
    return [(name, unit) for name, unit in module.named_modules() if issubclass(type(unit), kind)]


def original_class(unit: nn.Module) -> type[nn.Module]:
    """The class ``fully_shard`` swapped for ``FSDP<Name>`` (``FSDPModule._orig_cls_mro_index`` in its MRO)."""
    index = getattr(type(unit), "_orig_cls_mro_index", 2)
    found: type[nn.Module] = type(unit).__mro__[index]
    return found


def whole_parameter(parameter: Tensor, mode: FakeTensorMode) -> nn.Parameter:
    """A fake parameter of ``parameter``'s global shape and dtype, on the device its shard is on."""
    with mode:
        data = torch.empty(parameter.shape, dtype=parameter.dtype, device=parameter.device)
    return nn.Parameter(data, requires_grad=parameter.requires_grad)


def _is_fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` (a function, bound method or torch's ``_WrappedHook``) is FSDP's own."""
    inner = getattr(hook, "hook", hook)
    function = getattr(inner, "__func__", inner)
    return str(getattr(function, "__module__", "") or "").startswith(FSDP_CODE)


def _hook_tables(module: nn.Module) -> list[dict[Any, Any]]:
    """The module's hook tables: its attributes named ``*hooks*`` that are dicts (keyed by each hook's id)."""
    return [value for name, value in vars(module).items() if "hooks" in name and isinstance(value, dict)]


class Unsharding:
    """What the copy of a live FSDP2 module holds instead of FSDP's objects, by each object's ``id``.

    Args:
        module: the live module (not changed).
        mode: the replay's fake mode.
    """

    def __init__(self, module: nn.Module, mode: FakeTensorMode) -> None:
        self.module, self.mode = module, mode

    def fill(self, memo: dict[int, Any]) -> None:
        """Put into ``memo`` the copies of the module's FSDP objects; call under the copy's ``FakeCopyMode``.

        Each DTensor parameter's copy is a whole fake parameter; each unit's an instance of its original class, its
        attributes copied but FSDP's state and hooks; each hook table holding one of FSDP's hooks, its copy without;
        a device mesh a module holds (Lightning's ``device_mesh``), ``None`` (the replay's sharding sets its own).
        """
        from torch.distributed.device_mesh import DeviceMesh

        for parameter in self.module.parameters():
            if DTENSOR is not None and isinstance(parameter, DTENSOR):
                memo[id(parameter)] = whole_parameter(parameter, self.mode)
        for child in self.module.modules():
            memo.update((id(value), None) for value in vars(child).values() if isinstance(value, DeviceMesh))
        dropped: set[Any] = set()
        for child in self.module.modules():
            for table in _hook_tables(child):
                dropped.update(key for key, hook in table.items() if _is_fsdp_hook(hook))
        units = [unit for _name, unit in fsdp2_units(self.module)]
        shells = {id(unit): original_class(unit).__new__(original_class(unit)) for unit in units}
        memo.update(shells)
        for child in self.module.modules():
            for table in _hook_tables(child):
                if any(key in dropped for key in table):
                    kept = type(table)((key, value) for key, value in table.items() if key not in dropped)
                    memo[id(table)] = copy.deepcopy(kept, memo)
        for unit in units:
            attributes = {name: value for name, value in vars(unit).items() if not name.startswith(STATE_KEY_PREFIX)}
            vars(shells[id(unit)]).update(copy.deepcopy(attributes, memo))


def live_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` (or a module under it) is a ``fully_shard`` unit."""
    return bool(fsdp2_units(module))
