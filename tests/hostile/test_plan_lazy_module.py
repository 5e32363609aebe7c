"""``plan()`` on a module with lazy parameters (``nn.LazyLinear`` before its first forward).

DistributedDataParallel cannot wrap such a module: the plan leaves DDP's rows out saying so, instead of failing in
its bucket arithmetic on an uninitialized parameter, and the user's module keeps its parameters uninitialized.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from lightning_vram.plan import plan
from lightning_vram.prediction.strategies.ddp import LAZY_SKIP


class Lazy(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.LazyLinear(4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_a_plan_of_a_lazy_module_leaves_ddp_out_saying_why() -> None:
    module = Lazy()
    result = plan(
        module,
        torch.zeros(8, 16),
        gpus=["T4"],
        world_sizes=(2,),
        strategies=("ddp",),
        precisions=("32-true",),
        checkpointing=(False,),
        budget_seconds=120,
    )
    assert result.left_out == (f"{LAZY_SKIP}: ddp x2, 32-true, micro-batch 8",)
    assert all(isinstance(parameter, UninitializedParameter) for parameter in module.parameters())
