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

FSDP1 (``FullyShardedDataParallel``) wraps each unit in a ``FullyShardedDataParallel`` module holding it as
``_fsdp_wrapped_module``, and flattens the unit's parameters into one ``FlatParameter`` holding this rank's shard:
with ``use_orig_params=False`` the flat parameter is the unit's only registered parameter (on the wrapped module),
each original one a plain tensor attribute viewing it; with ``use_orig_params=True`` the originals stay registered,
each a view of the shard. The twin holds in each wrapper's place an :class:`UnwrappedShell` around its inner
module's copy, under the same name (the wrapper, its state, handle and hooks not copied), and each original
parameter as a fake parameter of its whole shape (the flat parameter's ``_shapes``) registered again on its module,
a parameter shared in the unit (``_shared_param_infos``) one object; the flat parameter itself has no copy
(:meth:`Unsharding.finish`). Nothing of the live wrappers, flat parameters or FSDP1's state is changed, no
collective runs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from lightning_vram.measure.fsdp1 import flat_parameters, fsdp1_wrappers
from lightning_vram.measure.storages import DTENSOR, FSDP_MODULE
from lightning_vram.prediction.replay._fake import FakeTensorMode

WRAPPED = "_fsdp_wrapped_module"
"""The name FSDP1's wrapper holds its inner module under (torch 2.13, ``_FSDP_WRAPPED_MODULE``)."""
FLAT_PARAMETER = "_flat_param"
"""The name FSDP1 registers a unit's flat parameter under, on its wrapped module (torch 2.13, ``FLAT_PARAM``)."""

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


class UnwrappedShell(nn.Module):
    """An FSDP1 wrapper's place in the twin: its inner module's copy under the same name, run and read through.

    The module names the advice's changes use (``_fsdp_wrapped_module.1``) are the live module's, so the twin keeps
    them; the shell holds no state, hook or parameter of its own.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The inner module's forward (FSDP1's without gathering, casting or hooks)."""
        return self._modules[WRAPPED](*args, **kwargs)  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        """The shell's own submodule, else the inner module's attribute (as FSDP1's wrapper reads through)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED or WRAPPED not in vars(self).get("_modules", {}):
                raise
            return getattr(self._modules[WRAPPED], name)

    def __getitem__(self, key: Any) -> Any:
        """The inner module's item (an ``nn.Sequential``'s layer), as FSDP1's wrapper gives it."""
        return self._modules[WRAPPED][key]  # type: ignore[index]


def is_flat_parameter(tensor: Tensor) -> bool:
    """Whether ``tensor`` is one of FSDP1's flat parameters."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    return isinstance(tensor, FlatParameter)


def live_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is (or holds) an FSDP1 wrapper or a flat parameter of FSDP1's."""
    return bool(fsdp1_wrappers(module) or flat_parameters(module))


def _original_places(flat: Any) -> list[tuple[nn.Module, str, int]]:
    """Where each original parameter of ``flat`` lives: its module, its name, and its index in ``flat._shapes``.

    A parameter shared in the unit appears once per place, with the index of the first place it is in.
    """
    places = [(info.module, info.param_name, index) for index, info in enumerate(flat._param_infos)]
    first = {(id(info.module), info.param_name): index for index, info in enumerate(flat._param_infos)}
    for shared in flat._shared_param_infos:
        places.append((shared.module, shared.param_name, first[(id(shared.prim_module), shared.prim_param_name)]))
    return places


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
        self.flats = flat_parameters(module)
        """FSDP1's flat parameters of the module (none for FSDP2 and ZeRO-3)."""
        self.wholes: list[tuple[nn.Module, str, nn.Parameter]] = []
        """Each FSDP1 original parameter's place (its live module and name) and its whole fake parameter."""

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
        self._fill_fsdp1(memo)
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
        for wrapper in reversed(fsdp1_wrappers(self.module)):  # innermost first: an outer one's copy holds its copy
            shell = UnwrappedShell()
            shell.training = wrapper.training
            shell._modules[WRAPPED] = copy.deepcopy(wrapper._modules[WRAPPED], memo)
            memo[id(wrapper)] = shell

    def _fill_fsdp1(self, memo: dict[int, Any]) -> None:
        """FSDP1: each original parameter's whole fake parameter in the memo; each flat parameter copied as ``None``.

        The original parameter is the registered one (``use_orig_params=True``) or the tensor attribute viewing the
        flat parameter (``use_orig_params=False``); either's copy is the whole parameter, registered by :meth:`finish`.
        """
        for flat in self.flats:
            memo[id(flat)] = None
            wholes: dict[int, nn.Parameter] = {}
            for owner, name, index in _original_places(flat):
                if index not in wholes:
                    with self.mode:
                        data = torch.empty(flat._shapes[index], dtype=flat.dtype, device=flat.device)
                    wholes[index] = nn.Parameter(data, requires_grad=flat.requires_grad)
                self.wholes.append((owner, name, wholes[index]))
                original = owner._parameters.get(name, vars(owner).get(name))
                if isinstance(original, Tensor):
                    memo[id(original)] = wholes[index]

    def finish(self, memo: dict[int, Any]) -> None:
        """After the copy: each FSDP1 whole parameter registered on its module's copy, the flat parameters dropped."""
        for module in self.module.modules():
            copied = memo.get(id(module))
            if FLAT_PARAMETER in module._parameters and isinstance(copied, nn.Module):
                copied._parameters.pop(FLAT_PARAMETER, None)
        for owner, name, whole in self.wholes:
            copied = memo[id(owner)]
            vars(copied).pop(name, None)  # use_orig_params=False: the view's copy held as a plain attribute
            copied._parameters[name] = whole


def live_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` (or a module under it) is a ``fully_shard`` unit."""
    return bool(fsdp2_units(module))


def sharded_live(module: nn.Module) -> bool:
    """Whether ``module`` is sharded by FSDP2, FSDP1 or ZeRO-3 (copied unsharded by :class:`Unsharding`)."""
    return (
        live_fsdp2(module)
        or live_fsdp1(module)
        or any(zero3_shape(parameter) is not None for parameter in module.parameters())
    )
