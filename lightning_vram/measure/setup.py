"""The training set-up the advice rules need, read from the model, its optimizers and its DataLoader.

Lightning-free: the callback fills in what its Trainer knows (precision, accumulation, strategy, world size); a
plain loop or a Fabric loop passes what it has, and the rest keeps its single-process default.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader

from lightning_vram.measure.accounting import local_tensor
from lightning_vram.measure.deepspeed_zero import full_numel, parameter_bytes, wrapped_optimizer
from lightning_vram.records import LinearLayer, TrainingSetup


def first_dataloader(loaders: Any) -> DataLoader[Any] | None:
    """The first DataLoader inside ``loaders`` (a DataLoader, or dicts, lists and tuples of them), or ``None``."""
    if isinstance(loaders, DataLoader):
        return loaders
    values = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else ()
    for value in values:
        found = first_dataloader(value)
        if found is not None:
            return found
    return None


def cpu_cores() -> int:
    """Cores this process may run on (its affinity where the platform tells), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _parameter_key(parameter: Tensor) -> int:
    """What identifies a parameter's memory: its (local shard's) storage address, or the object where it has none.

    A DTensor (FSDP2) is identified by its local shard; ZeRO-3 and uninitialised (lazy) parameters have no storage.
    """
    if is_lazy(parameter):  # uninitialised (a lazy module before its first forward): no storage yet
        return id(parameter)
    address = local_tensor(parameter).untyped_storage().data_ptr()
    return address if address else id(parameter)


def _whole_bytes(parameter: Tensor) -> int:
    if is_lazy(parameter):  # uninitialised: no size yet
        return 0
    return full_numel(parameter) * parameter.element_size()


def linear_layers(module: nn.Module) -> tuple[LinearLayer, ...]:
    """Every ``nn.Linear`` of ``module`` with the bytes of the parameters it owns alone.

    A parameter that another module holds too (a language model's ``lm_head`` tied to its embedding) is not
    the Linear's own: it counts once, with the module it is tied to, and the Linear's own bytes exclude it.

    >>> embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    >>> head.weight = embedding.weight
    >>> [(layer.name, layer.weight_bytes) for layer in linear_layers(nn.ModuleDict({"wte": embedding, "head": head}))]
    [('head', 0)]
    """
    owners = Counter(
        _parameter_key(parameter)
        for child in module.modules(remove_duplicate=False)
        for parameter in child.parameters(recurse=False)
    )

    def own_bytes(parameter: Tensor | None) -> int:
        if parameter is None or owners[_parameter_key(parameter)] > 1:
            return 0
        return _whole_bytes(parameter)

    return tuple(
        LinearLayer(
            name=name,
            in_features=child.in_features,
            out_features=child.out_features,
            parameter_bytes=own_bytes(child.weight) + own_bytes(child.bias),
            weight_bytes=own_bytes(child.weight),
        )
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear)
    )


def inplace_keeps_result(module: nn.Module) -> bool:
    """Whether the inplace variant of activation module ``module`` saves only its result, tried on 16 numbers.

    ``relu_``, ``leaky_relu_`` and ``elu_`` compute their gradient from their result, so inplace the input and the
    output become one saved tensor; others (``hardtanh_``, ``silu_``) keep a copy of the input they overwrite, or
    refuse backward (``leaky_relu_`` with a negative slope), and inplace saves nothing there. The trial runs a copy
    of the module's ``forward`` (no hooks, the module itself untouched) on a CPU tensor.

    >>> inplace_keeps_result(nn.LeakyReLU()), inplace_keeps_result(nn.SiLU()), inplace_keeps_result(nn.Linear(2, 2))
    (True, False, False)
    """
    if getattr(module, "inplace", None) is not False or any(True for _ in (*module.parameters(), *module.buffers())):
        return False
    trial = copy.copy(module)
    trial.inplace = True  # type: ignore[assignment]  # nn.Module annotates attributes as tensors or modules
    saved: set[int] = set()

    def pack(tensor: Tensor) -> Tensor:
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    start = torch.linspace(-2.0, 2.0, 16, requires_grad=True)  # both sides of zero
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            values = start.clone()
            result = trial.forward(values)
        if not isinstance(result, Tensor):
            return False
        torch.autograd.grad(result.sum(), start)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):  # an activation that refuses this trial
        return False
    address = values.untyped_storage().data_ptr()
    return result.untyped_storage().data_ptr() == address and saved == {address}


def user_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer inside the wrappers around it (Fabric's, DeepSpeed's ZeRO optimizer)."""
    inner = wrapped_optimizer(optimizer)
    nested = getattr(inner, "optimizer", None)  # Fabric's wrapper exposes the optimizer it wraps here
    while isinstance(nested, torch.optim.Optimizer) and nested is not inner:
        inner, nested = nested, getattr(nested, "optimizer", None)
    return inner


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The class name of the user's optimizer inside the wrappers around it.

    >>> optimizer_name(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    'SGD'
    """
    return type(user_optimizer(optimizer)).__name__


def training_setup(
    module: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    dataloaders: Any = None,
    precision: str = "32-true",
    automatic_optimization: bool = True,
    accumulate_grad_batches: int = 1,
    devices_per_node: int = 1,
    world_size: int = 1,
    strategy: str = "SingleDeviceStrategy",
) -> TrainingSetup:
    """What the rules need to know about how training is set up."""
    loader = first_dataloader(dataloaders)
    return TrainingSetup(
        precision=precision,
        automatic_optimization=automatic_optimization,
        accumulate_grad_batches=accumulate_grad_batches,
        optimizers=tuple(optimizer_name(optimizer) for optimizer in optimizers),
        num_workers=loader.num_workers if loader is not None else None,
        pin_memory=loader.pin_memory if loader is not None else None,
        cpu_cores_per_device=max(1, cpu_cores() // max(1, devices_per_node)),
        world_size=world_size,
        strategy=strategy,
        parameter_bytes=parameter_bytes(module),
        linear_layers=linear_layers(module),
        inplace_keeps_result=tuple(name for name, child in module.named_modules() if inplace_keeps_result(child)),
    )
