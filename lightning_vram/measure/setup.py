"""The training set-up the advice rules need, read from the model, its optimizers and its DataLoader.

Lightning-free: the callback fills in what its Trainer knows (precision, accumulation, strategy, world size); a
plain loop or a Fabric loop passes what it has, and the rest keeps its single-process default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_vram.measure.deepspeed_zero import parameter_bytes, wrapped_optimizer
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


def linear_layers(module: nn.Module) -> tuple[LinearLayer, ...]:
    """Every ``nn.Linear`` of ``module`` with its own parameter bytes."""
    return tuple(
        LinearLayer(
            name=name,
            in_features=child.in_features,
            out_features=child.out_features,
            parameter_bytes=parameter_bytes(child),
        )
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear)
    )


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
        optimizers=tuple(type(wrapped_optimizer(optimizer)).__name__ for optimizer in optimizers),
        num_workers=loader.num_workers if loader is not None else None,
        pin_memory=loader.pin_memory if loader is not None else None,
        cpu_cores_per_device=max(1, cpu_cores() // max(1, devices_per_node)),
        world_size=world_size,
        strategy=strategy,
        parameter_bytes=parameter_bytes(module),
        linear_layers=linear_layers(module),
    )
