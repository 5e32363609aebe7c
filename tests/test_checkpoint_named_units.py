"""The checkpointing advice names a U-Net's units as its printed code wraps them: listed, not "``enc1`` to ``dec2``".

A trial's U-Net (children ``enc1``, ``enc2``, ``enc3``, ``pool``, ``up2``, ``dec2``, ``up1``, ``dec1``, ``head``;
skip connections, cross-entropy over pixels) was advised "Checkpoint `enc1` to `dec2` (5 units)", whose code wraps
``enc1``, ``enc2``, ``enc3``, ``pool`` and ``dec2``: not ``up2``, which the title's span runs through; and
``predict(memory_budget=...)`` printed "checkpoint `enc1` to `pool` (3 units)" for ``enc1``, ``enc2`` and ``pool``,
without ``enc3``. Named children's names tell no order: the title now lists them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from models import loader, trainer
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.records import AdviceId, CheckpointPlan


def _block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1), nn.GroupNorm(4, outputs), nn.ReLU(),
        nn.Conv2d(outputs, outputs, 3, padding=1), nn.GroupNorm(4, outputs), nn.ReLU(),
    )  # fmt: skip


class UNet(pl.LightningModule):
    def __init__(self, classes: int = 5, width: int = 8) -> None:
        super().__init__()
        self.enc1, self.enc2, self.enc3 = _block(3, width), _block(width, 2 * width), _block(2 * width, 4 * width)
        self.pool = nn.MaxPool2d(2)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2), _block(4 * width, 2 * width)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2), _block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, images: Tensor) -> Tensor:
        first = self.enc1(images)
        second = self.enc2(self.pool(first))
        third = self.enc3(self.pool(second))
        up = self.dec2(torch.cat([self.up2(third), second], 1))
        return self.head(self.dec1(torch.cat([self.up1(up), first], 1)))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, masks = batch
        return F.cross_entropy(self(images), masks)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    return TensorDataset(images, torch.randint(0, 5, (samples, 32, 32), generator=generator))


@pytest.mark.replay  # the plan is replayed on the run's step
def test_the_advice_lists_the_units_its_code_wraps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=2).fit(UNet(), loader(_data(16), 8))
    assert monitor.report is not None
    advice = next((item for item in monitor.report.advice if item.id is AdviceId.ACTIVATION_CHECKPOINTING), None)
    assert advice is not None, [item.id for item in monitor.report.advice]
    wrapped = re.findall(r"^self\.(\w+) = Checkpointed\(self\.\1\)$", advice.detail, re.M)
    children = [name for name, _ in UNet().named_children()]
    # The plan skips a child between its first unit and its last (what makes "A to B" wrong).
    between = children[children.index(wrapped[0]) : children.index(wrapped[-1]) + 1]
    assert len(wrapped) >= 3 and set(between) > set(wrapped), (wrapped, between)
    named = re.findall(r"`(\w+)`", advice.title)
    # Before: "Checkpoint `enc1` to `dec2` (5 units) ...": ['enc1', 'dec2'].
    assert named == wrapped, (advice.title, wrapped)


def test_named_units_are_listed_and_a_layer_stack_is_a_range() -> None:
    unet = CheckpointPlan("", (("enc1",), ("enc2",), ("enc3",), ("pool",), ("dec2",)), None, 0)
    # Before: "`enc1` to `dec2` (5 units)".
    assert unet.span_text("`") == "`enc1`, `enc2`, `enc3`, `pool` and `dec2` (5 units)"
    stem = CheckpointPlan("", (("conv1", "bn1", "relu"), ("layer1",), ("layer2",)), None, 0, selective=("layer1",))
    assert stem.span_text() == "conv1+bn1+relu, layer1 and layer2 (3 units, 1 selectively)"
    seq2seq = CheckpointPlan("m", (("m.enc.0",), ("m.enc.1",), ("m.dec.0",), ("m.dec.1",)), None, 0)
    assert seq2seq.span_text("`") == "`m.enc.0-1` and `m.dec.0-1` (4 units)"
    stack = CheckpointPlan("h", (("h.0",), ("h.1",), ("h.2",)), None, 0)
    assert stack.span_text("`") == "`h.0` to `h.2` (3 units)"  # indices tell the order: unchanged
