"""A checkpointing plan whose wrapper its caller treats otherwise than the module is never advised.

guided-diffusion's and Stable Diffusion's ``TimestepEmbedSequential`` passes the timestep embedding only to children
that are ``isinstance(layer, TimestepBlock)``; a block's ``emb`` defaults to ``None``. The printed ``Checkpointed``
wrapper is no ``TimestepBlock``: wrapped, the blocks would run without the embedding and the model would learn
another function. The replay sets what each checkpointed unit receives and returns against the step without the
plan, and discards such a plan saying why.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from models import loader, trainer
from test_checkpointing_same_model import Trained, advised, apply_printed, assert_same, train
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.advice.checkpoint_code import CHECKPOINTED_CLASS, KEEPING_BUFFERS
from lightning_vram.records import CheckpointChange

pytestmark = pytest.mark.replay

WIDTH = 64
BATCH = 256


class TimestepBlock(nn.Module):
    """A residual block that adds the timestep embedding where it is given one."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.emb = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.linear(self.norm(x))
        if emb is not None:
            hidden = hidden + self.emb(emb)
        return x + functional.silu(hidden)


class TimestepEmbedSequential(nn.Sequential):
    """Passes the embedding to the children that are :class:`TimestepBlock`, the input alone to the others."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for layer in self:
            x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
        return x


class Denoiser(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inputs = nn.Linear(16, WIDTH)
        self.time = nn.Embedding(100, WIDTH)
        self.blocks = TimestepEmbedSequential(*(TimestepBlock() for _ in range(6)))
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inputs(x), self.time(t)))  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, t = batch
        noise = torch.randn_like(x)
        return functional.mse_loss(self(x + noise, t), noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(BATCH * 6, 16, generator=generator), torch.randint(0, 100, (BATCH * 6,), generator=generator)
    )


def trained(code: str = "") -> Trained:
    torch.manual_seed(1)
    module = Denoiser()
    if code:
        printed: dict[str, object] = {}
        definitions, _, lines = code.partition("\n# in ")
        exec(definitions, printed)
        exec("\n".join(lines.split("\n")[1:]), {**printed, "self": module})
    return train(module, data(), BATCH, steps=4)


def test_wrapping_blocks_a_caller_tells_apart_by_class_trains_another_model() -> None:
    """Why the plan must not be printed: the wrapper's blocks get no embedding."""
    wrapped = (
        f"{KEEPING_BUFFERS}\n\n{CHECKPOINTED_CLASS}\n# in the LightningModule's __init__:\n"
        "for index in range(0, 6):\n    self.blocks[index] = Checkpointed(self.blocks[index])"
    )
    assert trained(wrapped).losses != trained().losses


def test_plans_over_blocks_a_caller_tells_apart_by_class_are_discarded(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(Denoiser(), loader(data(), BATCH))
    report = monitor.report
    assert report is not None and report.simulation is not None
    # Whatever checkpointing is advised, applied as printed, trains the same model.
    if any(advice.id == "activation-checkpointing" for advice in report.advice):
        _, plan, code = advised(report)
        torch.manual_seed(1)
        module = Denoiser()
        apply_printed(module, plan, code)
        assert_same(trained(), train(module, data(), BATCH, steps=4))
    over_blocks = [
        variant
        for variant in report.simulation.variants
        if isinstance(variant.change, CheckpointChange)
        and any(unit[0].startswith("blocks.") for unit in variant.change.plan.units)
    ]
    assert over_blocks
    for variant in over_blocks:
        assert variant.replayed is None and variant.discarded is not None
        assert "other arguments with the plan" in variant.discarded and "isinstance" in variant.discarded
