"""A live FSDP2 or ZeRO-3 module as the replay's twin copies it: unsharded, without the strategy's state or hooks.

``fully_shard`` turns each parameter of a unit into a DTensor of the whole (global) shape holding this rank's shard,
swaps each unit's class for an ``FSDP<Name>`` subclass (which refuses ``deepcopy``), keeps its state (process groups,
streams, the parameters' shards) under the module's composable-API keys, and registers hooks (forward, state dict)
on the modules. The twin is the module as it was before: each DTensor parameter copied as a plain fake parameter of
its global shape and dtype on this rank's device (:func:`whole_parameter`), each unit an instance of its original
class with the same attributes and submodules, every hook FSDP registered left out, FSDP's state not copied at all.
Nothing of the real module is changed or read beyond its attributes: the shards' values are never read, no
collective runs. A rank's replay shards the twin again its own way
(:mod:`~lightning_vram.prediction.strategies.fsdp2`).

DeepSpeed's ZeRO-3 empties each parameter's ``.data`` (its whole shape is ``param.ds_shape``, this rank's partition
``param.ds_tensor``) and registers its fetch and release hooks on every module: the twin's parameter is a fake one of
``ds_shape``, every hook whose code is DeepSpeed's left out; the classes are the module's own. The replay runs the
unsharded step, which the per-rank arithmetic turns into the rank's
(:mod:`~lightning_vram.prediction.strategies.deepspeed`).
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
STRATEGY_CODE = ("torch.distributed.fsdp", "deepspeed")
"""The packages whose functions and methods FSDP2 and ZeRO-3 register as hooks."""


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


def zero3_shape(parameter: Tensor) -> torch.Size | None:
    """The whole shape of a parameter ZeRO-3 partitioned (``ds_shape``); ``None`` for any other parameter."""
    shape = getattr(parameter, "ds_shape", None)
    return torch.Size(shape) if shape is not None else None


def whole_parameter(parameter: Tensor, mode: FakeTensorMode) -> nn.Parameter:
    """A fake parameter of ``parameter``'s whole shape and dtype, on the device its shard is on.

    The whole shape is ZeRO-3's ``ds_shape``, else the parameter's own (a DTensor's is the global one).
    """
    shape = zero3_shape(parameter) or parameter.shape
    with mode:
        data = torch.empty(shape, dtype=parameter.dtype, device=parameter.device)
    return nn.Parameter(data, requires_grad=parameter.requires_grad)


def _is_strategy_hook(hook: Any) -> bool:
    """Whether ``hook`` (a function, bound method or torch's ``_WrappedHook``) is FSDP's or DeepSpeed's own."""
    inner = getattr(hook, "hook", hook)
    function = getattr(inner, "__func__", inner)
    return str(getattr(function, "__module__", "") or "").startswith(STRATEGY_CODE)


def _hook_tables(module: nn.Module) -> list[dict[Any, Any]]:
    """The module's hook tables: its attributes named ``*hooks*`` that are dicts (keyed by each hook's id)."""
    return [value for name, value in vars(module).items() if "hooks" in name and isinstance(value, dict)]


class Unsharding:
    """What the copy of a live sharded module holds instead of the strategy's objects, by each object's ``id``.

    Args:
        module: the live module (not changed).
        mode: the replay's fake mode.
    """

    def __init__(self, module: nn.Module, mode: FakeTensorMode) -> None:
        self.module, self.mode = module, mode

    def fill(self, memo: dict[int, Any]) -> None:
        """Put into ``memo`` the copies of the strategy's objects; call under the copy's ``FakeCopyMode``.

        Each DTensor or ZeRO-3 parameter's copy is a whole fake parameter; each FSDP2 unit's an instance of its
        original class, its attributes copied but FSDP's state; each hook table holding one of FSDP's or DeepSpeed's
        hooks, its copy without; a device mesh a module holds (Lightning's ``device_mesh``), ``None`` (the replay's
        sharding sets its own).
        """
        from torch.distributed.device_mesh import DeviceMesh

        for parameter in self.module.parameters():
            if (DTENSOR is not None and isinstance(parameter, DTENSOR)) or zero3_shape(parameter) is not None:
                memo[id(parameter)] = whole_parameter(parameter, self.mode)
        for child in self.module.modules():
            memo.update((id(value), None) for value in vars(child).values() if isinstance(value, DeviceMesh))
        dropped: set[Any] = set()
        for child in self.module.modules():
            for table in _hook_tables(child):
                dropped.update(key for key, hook in table.items() if _is_strategy_hook(hook))
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


def sharded_live(module: nn.Module) -> bool:
    """Whether ``module`` is sharded by FSDP2 or has a parameter ZeRO-3 partitioned (copied by :class:`Unsharding`)."""
    return live_fsdp2(module) or any(zero3_shape(parameter) is not None for parameter in module.parameters())
