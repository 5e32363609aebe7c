"""Reads the user's training set-up from the Trainer and the model, for the advice rules.

With callback.py, the only module that knows Lightning.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader

from lightning_vram.advice import LinearLayer, TrainingSetup
from lightning_vram.deepspeed_zero import parameter_bytes, wrapped_optimizer


def _first_dataloader(loaders: Any) -> DataLoader[Any] | None:
    if isinstance(loaders, DataLoader):
        return loaders
    values = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else ()
    for value in values:
        found = _first_dataloader(value)
        if found is not None:
            return found
    return None


def _cpu_cores() -> int:
    """Cores this process may run on (its affinity where the platform tells), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def training_setup(trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainingSetup:
    """What the rules need to know about how training is set up."""
    loader = _first_dataloader(trainer.train_dataloader)
    linear_layers = tuple(
        LinearLayer(
            name=name,
            in_features=module.in_features,
            out_features=module.out_features,
            parameter_bytes=parameter_bytes(module),
        )
        for name, module in pl_module.named_modules()
        if isinstance(module, nn.Linear)
    )
    return TrainingSetup(
        precision=str(trainer.precision),
        automatic_optimization=pl_module.automatic_optimization,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        optimizers=tuple(type(wrapped_optimizer(optimizer)).__name__ for optimizer in trainer.optimizers),
        num_workers=loader.num_workers if loader is not None else None,
        pin_memory=loader.pin_memory if loader is not None else None,
        cpu_cores_per_device=max(1, _cpu_cores() // max(1, trainer.num_devices)),
        world_size=trainer.world_size,
        strategy=type(trainer.strategy).__name__,
        parameter_bytes=parameter_bytes(pl_module),
        linear_layers=linear_layers,
    )
