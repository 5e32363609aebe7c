"""The replay's optimizers: the user's rebuilt on fake parameters, or the module's own ``configure_optimizers``.

An optimizer is rebuilt from its class and its param groups' settings, with its state faked from the real state.
One-element CPU tensors (Adam's ``step``) become fake *constants*, whose value the optimizer may read
(``step.item()``) without a real tensor behind it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_vram.measure.setup import user_optimizer
from lightning_vram.prediction.replay._fake import FakeTensorMode

CONSTANT_MAX_NUMEL = 1
"""Tensors up to this many elements on the CPU are faked as constants (fake tensors that keep their value)."""


@dataclass(frozen=True)
class _Constant:
    """A small CPU tensor's value, read before the fake mode starts, to become a fake constant inside it."""

    values: Any
    dtype: torch.dtype


def read_constants(value: Any) -> Any:
    """``value`` with every small CPU tensor replaced by its value; call it outside the fake mode."""

    def read(tensor: Tensor) -> Any:
        if tensor.device.type == "cpu" and tensor.numel() <= CONSTANT_MAX_NUMEL:
            return _Constant(tensor.detach().tolist(), tensor.dtype)
        return tensor

    return apply_to_collection(value, Tensor, read)


def fake_value(value: Any, mode: FakeTensorMode) -> Any:
    """``value`` (after :func:`read_constants`) with every tensor faked, constants as fake constants; in the mode."""

    def fake(item: Tensor | _Constant) -> Tensor:
        if isinstance(item, _Constant):
            return torch.tensor(item.values, dtype=item.dtype)
        return mode.from_tensor(item, static_shapes=True)

    return apply_to_collection(value, (Tensor, _Constant), fake)


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, parameters: Mapping[int, Tensor], mode: FakeTensorMode
) -> torch.optim.Optimizer:
    """``type(optimizer)`` over the fake parameters, with each param group's settings and the state faked.

    Call it outside ``mode`` (it reads small state tensors' values first). State tensors follow their parameter's
    dtype where a replay changed it (``bf16-true``). A wrapper (Fabric's) is looked through to the user's optimizer.
    """
    optimizer = user_optimizer(optimizer)
    settings = [
        read_constants({key: value for key, value in group.items() if key != "params"})
        for group in optimizer.param_groups
    ]
    states = [(parameter, read_constants(dict(state))) for parameter, state in optimizer.state.items()]
    with mode:
        groups = [
            {**fake_value(group_settings, mode), "params": [parameters[id(parameter)] for parameter in group["params"]]}
            for group_settings, group in zip(settings, optimizer.param_groups, strict=True)
        ]
        # Every setting lives in each group, so the class needs no other argument (custom ones may: then it raises).
        optimizer_class = cast(Callable[[list[dict[str, Any]]], torch.optim.Optimizer], type(optimizer))
        rebuilt = optimizer_class(groups)
        for parameter, state in states:
            fake_parameter = parameters[id(parameter)]
            rebuilt.state[fake_parameter] = {
                key: value if key == "step" else _follow_dtype(value, parameter, fake_parameter)
                for key, value in fake_value(state, mode).items()
            }
    return rebuilt


def _follow_dtype(value: Any, real: Tensor, fake: Tensor) -> Any:
    """A parameter-shaped state tensor as the fake parameter is: its dtype where the replay cast it (floating).

    And on its device, where the replay moved it (``placement``).
    """
    if not isinstance(value, Tensor) or value.shape != real.shape:
        return value
    if value.is_floating_point() and real.dtype != fake.dtype and fake.is_floating_point():
        value = value.to(fake.dtype)
    if value.device != fake.device:
        value = value.to(fake.device)
    return value


def configured_optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers a LightningModule's ``configure_optimizers`` returns, in any of Lightning's formats.

    An optimizer; a list or tuple of them; ``(optimizers, schedulers)``; a dict with ``"optimizer"``; a list of
    such dicts; ``None`` (no optimizer). Schedulers are left out: they hold no memory on the device.
    """
    configure = getattr(module, "configure_optimizers", None)
    if not callable(configure):
        raise TypeError(f"{type(module).__name__} has no configure_optimizers: pass its optimizers")
    return _optimizers_in(configure())


def _optimizers_in(value: Any) -> list[torch.optim.Optimizer]:
    if value is None:
        return []
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, Mapping):
        return _optimizers_in(value.get("optimizer"))
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], (list, tuple)):  # (optimizers, schedulers)
            return _optimizers_in(value[0])
        return [optimizer for item in value for optimizer in _optimizers_in(item)]
    raise TypeError(f"configure_optimizers returned {type(value).__name__}, which holds no optimizer Lightning knows")


_PLAIN = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class OptimizerShape:
    """A configured optimizer without its tensors: its class, first group's plain settings and groups' sizes.

    Each group's trainable parameters are kept as their element counts, read from the optimizer a replay's copy of
    the module configured (:meth:`of`), so that arithmetic over the state (a ZeRO partition's moments) sizes it by
    the user's own optimizer without calling ``configure_optimizers`` on the user's module outside the replay's
    containment.
    """

    kind: type[torch.optim.Optimizer]
    settings: tuple[tuple[str, Any], ...]
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerShape:
        """The shape of ``optimizer`` (a replay's, on fake parameters: only their sizes are read).

        >>> shape = OptimizerShape.of(torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1, momentum=0.9))
        >>> shape.kind.__name__, shape.groups, dict(shape.settings)["momentum"]
        ('SGD', ((3,),), 0.9)
        """
        first = optimizer.param_groups[0]
        settings = tuple(
            (key, value)
            for key, value in first.items()
            if key != "params"
            and (isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)))
        )
        groups = tuple(
            tuple(int(getattr(p, "ds_numel", None) or p.numel()) for p in group["params"] if p.requires_grad)
            for group in optimizer.param_groups
        )
        return cls(optimizer.__class__, settings, groups)

    def build(self) -> torch.optim.Optimizer | None:
        """An optimizer of this class and settings over meta tensors of the groups' sizes; ``None`` if it refuses.

        No memory and no state: meta tensors hold none. A class of the user's may refuse meta tensors or the settings.

        >>> built = OptimizerShape(torch.optim.SGD, (("lr", 0.1), ("momentum", 0.9)), ((3, 4),)).build()
        >>> [[p.numel() for p in group["params"]] for group in built.param_groups], built.defaults["momentum"]
        ([[3, 4]], 0.9)
        """
        groups = [
            {"params": [torch.empty(numel, device="meta", requires_grad=True) for numel in group]}
            for group in self.groups
            if group
        ]
        if not groups:
            return None
        accepted = inspect.signature(self.kind).parameters
        try:
            return self.kind(groups, **{key: value for key, value in self.settings if key in accepted})
        except Exception:  # noqa: BLE001 - a class of the user's that refuses meta tensors or these settings
            return None
