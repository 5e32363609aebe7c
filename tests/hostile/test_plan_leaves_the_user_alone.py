"""``plan()`` reads the user's module and first batch and leaves the user's world as it was.

A plan with no batch reads the first batch of the module's own ``train_dataloader`` (or of a datamodule's): a
shuffled loader draws its order from torch's generator, and a dataset's augmentation from NumPy's and Python's. A
training run after the plan must be the one it would be without it: every generator's state, the module's state,
its counters and the globals its code counts in are compared exactly before and after.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_vram.plan import plan

CALLS = {"forward": 0, "configure_optimizers": 0, "getitem": 0}
"""The globals the user's code counts its calls in."""


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Noise from NumPy's and Python's generators on each sample (an augmentation)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        CALLS["getitem"] += 1
        scale = float(np.random.rand()) + random.random()
        return torch.full((16,), scale), torch.tensor(index % 4)


class User(pl.LightningModule):
    """Batch norm, dropout, a counter in forward and configure_optimizers, its own shuffled loader."""

    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.Linear(32, 4))
        self.forwards = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        CALLS["forward"] += 1
        self.forwards += 1
        return self.network(inputs)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs + torch.randn_like(inputs)), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        CALLS["configure_optimizers"] += 1
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Augmented(), batch_size=8, shuffle=True)


class UserData(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Augmented(), batch_size=8, shuffle=True)


def world(module: User) -> dict[str, Any]:
    """What training after the plan would start from: the generators, the module, the globals."""
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": repr(np.random.get_state()),
        "python": random.getstate(),
        "state": {name: tensor.tolist() for name, tensor in module.state_dict().items()},
        "grads": [parameter.grad for parameter in module.parameters()],
        "modes": [child.training for child in module.modules()],
        "forwards": module.forwards,
        "calls": {key: value for key, value in CALLS.items() if key != "getitem"},  # the first batch is read
    }


@pytest.mark.parametrize("source", ["own loader", "datamodule", "batch given"])
def test_a_plan_leaves_the_generators_module_and_globals_as_they_were(source: str) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    module = User()
    before = world(module)
    batch = (torch.zeros(8, 16), torch.zeros(8, dtype=torch.int64)) if source == "batch given" else None
    datamodule = UserData() if source == "datamodule" else None
    result = plan(
        module,
        batch,
        datamodule=datamodule,
        gpus=["T4"],
        world_sizes=(1,),
        precisions=("32-true",),
        checkpointing=(False,),
        budget_seconds=120,
    )
    assert result.left_out == ()
    assert world(module) == before
