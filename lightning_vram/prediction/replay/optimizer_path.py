"""The optimizer path the real run takes (fused, foreach or for-loop), set on the replay's optimizers.

torch picks the path at each ``step`` where the user left both ``foreach`` and ``fused`` unset: foreach when every
parameter is exactly a ``Tensor`` or a ``Parameter`` on a device with foreach kernels (CUDA), else the for-loop; it
never picks fused by default (``torch.optim.optimizer._default_to_fused_or_foreach`` with ``use_fused=False``,
torch 2.13). The replay's parameters are fake tensors, a subclass: left to itself, the replay's optimizer would take
the for-loop where the real one takes foreach, which holds a parameter-sized intermediate for the whole group at
once (Adam's ``exp_avg_sq.sqrt()`` of every parameter) instead of one parameter's at a time. So the path is resolved
for the real parameters (:func:`resolve_path`) and set explicitly on the replay's param groups
(:func:`follow_real_path`). On the CPU the real path is the for-loop, as the replay's was.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices  # torch's own list (private)

FOREACH_TYPES: tuple[type, ...] = (Tensor, nn.Parameter)
"""The parameter types torch takes the foreach path for: exactly these, not a subclass."""


class OptimizerPath(enum.Enum):
    """How an optimizer's step runs over a param group."""

    FUSED = "fused"
    FOREACH = "foreach"
    FOR_LOOP = "for-loop"


def foreach_devices() -> tuple[str, ...]:
    """The device types with foreach kernels in the installed torch (CUDA, XPU, MTIA, the private backend)."""
    return tuple(_get_foreach_kernels_supported_devices())


def resolve_path(
    parameter_types: Sequence[type],
    device_types: Sequence[str],
    settings: Mapping[str, Any],
    optimizer_class: type,
) -> OptimizerPath:
    """The path torch takes for a param group of parameters of these types, on these device types.

    Args:
        parameter_types: ``type(p)`` of each of the group's parameters (the real ones).
        device_types: each parameter's device type (``"cuda"``), as the real run places it.
        settings: the group's settings (``foreach``, ``fused``, ``differentiable``, ``capturable``, ``lr``).
        optimizer_class: the optimizer's class (Adam and its subclasses keep the for-loop for a tensor ``lr``
            without ``capturable``).

    >>> resolve_path([nn.Parameter], ["cuda"], {"foreach": None, "fused": None}, torch.optim.SGD)
    <OptimizerPath.FOREACH: 'foreach'>
    >>> resolve_path([nn.Parameter], ["cpu"], {"foreach": None, "fused": None}, torch.optim.SGD)
    <OptimizerPath.FOR_LOOP: 'for-loop'>
    """
    if settings.get("fused"):
        return OptimizerPath.FUSED
    foreach = settings.get("foreach")
    if foreach is not None or settings.get("fused") is not None:
        return OptimizerPath.FOREACH if foreach else OptimizerPath.FOR_LOOP
    if settings.get("differentiable", False):
        return OptimizerPath.FOR_LOOP
    supported = foreach_devices()
    placed = zip(parameter_types, device_types, strict=True)
    if not all(kind in FOREACH_TYPES and device in supported for kind, device in placed):
        return OptimizerPath.FOR_LOOP
    tensor_lr = isinstance(settings.get("lr"), Tensor) and not settings.get("capturable", False)
    if tensor_lr and issubclass(optimizer_class, torch.optim.Adam):
        return OptimizerPath.FOR_LOOP
    return OptimizerPath.FOREACH


def follow_real_path(
    optimizer: torch.optim.Optimizer, real_types: Mapping[int, type], device_type: str | None = None
) -> None:
    """Set ``foreach`` on each of the (replay's) ``optimizer``'s param groups to the path the real run takes.

    ``real_types``: the type of the real parameter behind each fake one, by the fake one's ``id`` (a parameter not
    in it counts as its own type). ``device_type``: where the real run places the parameters (``"cuda"`` for a step
    predicted for CUDA but replayed on the CPU); ``None``: the fake parameter's device (where the replay places it).
    Only groups whose optimizer takes a ``foreach`` setting are touched; one the user set stays as set.
    """
    for group in optimizer.param_groups:
        if "foreach" not in group:
            continue
        parameters = [parameter for parameter in group["params"] if isinstance(parameter, Tensor)]
        path = resolve_path(
            [real_types.get(id(parameter), type(parameter)) for parameter in parameters],
            [device_type or parameter.device.type for parameter in parameters],
            group,
            type(optimizer),
        )
        if path is not OptimizerPath.FUSED:
            group["foreach"] = path is OptimizerPath.FOREACH
