"""Checkpointed units whose forward updates their buffers, then computes with them, train the same model.

Spectral normalisation's power iteration (``torch.nn.utils.parametrizations.spectral_norm``: the ``_u``, ``_v``
buffers of the parametrization; the older hook form's ``weight_u``, ``weight_v``) and a running-statistics normaliser
(RL observation normalisers, VQ-EMA codebooks) update buffers in forward and compute the output from the updated
values. Backward's recomputation must start from the buffers as the forward pass found them, or it computes another
weight or another normalisation than forward did, and the gradients differ. The printed code (and the replay's, the
same calls) recomputes on copies of the buffers kept when the forward pass ran; the buffers themselves change once a
step. Each model is trained with and without the printed code (whole and selective units), and with the replay's
own application of the plan on real tensors: losses, weights, buffers and the RNG state must be bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from test_checkpointing_same_model import Trained, apply_printed, assert_same, train
from torch import nn
from torch.nn import functional
from torch.nn.utils import spectral_norm as hooked_spectral_norm
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.data import TensorDataset

from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.prediction.replay.changes import apply_checkpoint_plan
from lightning_vram.records import CheckpointPlan

WIDTH = 32
BATCH = 64


class RunningNorm(nn.Module):
    """Updates its running mean and variance from the batch, then normalises with them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(WIDTH))
        self.register_buffer("var", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(x.mean(0), 0.1)
                self.var.lerp_(x.var(0), 0.1)
        return (x - self.mean) / torch.sqrt(self.var + 1e-5)


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "running-norm": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), RunningNorm(), nn.ReLU()),
    "spectral-norm": lambda: nn.Sequential(spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.LeakyReLU(0.2)),
    "spectral-norm-hook": lambda: nn.Sequential(hooked_spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.LeakyReLU(0.2)),
}


class Net(pl.LightningModule):
    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.inputs = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inputs(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


PLAN = CheckpointPlan("blocks", tuple((f"blocks.{index}",) for index in range(3)), None, 0, forward_of="")
PLANS = {"whole": PLAN, "selective": replace(PLAN, selective=("blocks.1", "blocks.2"))}


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(
        torch.randn(BATCH * 5, 8, generator=generator), torch.randint(0, 4, (BATCH * 5,), generator=generator)
    )


def trained(block: str, change: Callable[[nn.Module], None] | None = None) -> Trained:
    torch.manual_seed(1)
    module = Net(BLOCKS[block])
    if change is not None:
        change(module)
    return train(module, data(), BATCH, steps=5)


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_printed_checkpointing_of_units_updating_buffers_trains_the_same_model(block: str, plan: str) -> None:
    code = checkpoint_snippet(PLANS[plan])[1]
    assert "Checkpointed(self.blocks[index])" in code
    assert_same(trained(block), trained(block, lambda module: apply_printed(module, PLANS[plan], code)))


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_the_replays_checkpointing_of_units_updating_buffers_computes_the_same_model(block: str) -> None:
    """The replay's own application of the plan, run on real tensors: its recomputation is the printed one."""
    assert_same(trained(block), trained(block, lambda module: apply_checkpoint_plan(module, PLAN)))
