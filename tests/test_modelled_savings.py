"""Modelled savings against the replay's, on the model a new user's trial trained (a small ResNet with BatchNorm
and inplace ReLU), as it was and with the first checkpointing advice applied: its blocks then run through
``checkpoint`` on slices of their ``nn.Sequential``, so the stem's output goes to a checkpoint (which keeps it), not
to the pooling after it; and each block calls its one ReLU twice, so no unit can hold that ReLU.

A training step that reads ``loss.item()`` is not replayed (fake tensors have no values): its advice is modelled.
The same model without ``.item()`` is replayed. Each plan the checkpointing rule weighs is modelled on the first
run and replayed on the second; the modelled figure must be within 10% of the replayed one (the trial saw "stem
frees 8.0 MiB" modelled where the replay freed 4.0 MiB).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from models import trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.savings import Saving, resolve_saving
from lightning_vram.records import AdviceId, CheckpointChange, SavingBasis
from lightning_vram.units import format_bytes

pytestmark = pytest.mark.replay

TOLERANCE = 0.10
"""How far a modelled saving may stand from the replayed one, as a share of the replayed one..."""
SLACK_SHARE = 0.001
"""...or as a share of the replayed peak: a plan that frees a few KiB (a BatchNorm's statistics, the last block's
few non-boundary bytes) frees nothing worth advising, modelled or replayed."""


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, an inplace ReLU, and the identity added out of place, as the trial's user
    wrote it (tests/models.py's block adds it in place: another set of saved tensors)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class TinyResNet(pl.LightningModule):
    """A stem, four blocks of width 32 (with ``checkpointed``, the first three checkpointed one by one), pooling and a
    linear head."""

    def __init__(self, reads_loss: bool, checkpointed: bool, width: int = 32) -> None:
        super().__init__()
        self.reads_loss, self.checkpointed = reads_loss, checkpointed
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(*[BasicBlock(width) for _ in range(4)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, 10)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if not self.checkpointed:
            return self.fc(self.pool(self.blocks(x)).flatten(1))
        for start in range(3):
            segment = self.blocks[start : start + 1]
            x = checkpoint(segment, x, use_reentrant=False)
        x = self.blocks[3:](x)
        return self.fc(self.pool(x).flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        if self.reads_loss:
            self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(root: Path, reads_loss: bool, checkpointed: bool) -> Report:
    """Three steps of batch 32 (3x32x32 images) on the CPU, monitored; the monitor's report."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(96, 3, 32, 32, generator=generator), torch.randint(0, 10, (96,), generator=generator)
    )
    monitor = VramMonitor()
    trainer(root, [monitor], max_steps=3).fit(TinyResNet(reads_loss, checkpointed), DataLoader(data, batch_size=32))
    assert monitor.report is not None
    return monitor.report


@pytest.mark.parametrize("checkpointed", [False, True])
def test_modelled_checkpointing_savings_are_the_replayed_ones(tmp_path: Path, checkpointed: bool) -> None:
    modelled = fit(tmp_path / "item", reads_loss=True, checkpointed=checkpointed)
    replayed = fit(tmp_path / "replayed", reads_loss=False, checkpointed=checkpointed)
    assert modelled.simulation is not None and modelled.simulation.skipped is not None
    assert ".item()" in modelled.simulation.skipped
    assert replayed.simulation is not None and replayed.simulation.skipped is None
    assert replayed.summary.peak is not None
    plans = checkpoint_candidates(modelled.summary.modules)
    assert plans
    compared = []
    slack = SLACK_SHARE * replayed.summary.peak.peak_bytes
    for plan in plans:
        found = resolve_saving(replayed.simulation, CheckpointChange(plan), None, measured=replayed.summary.peak)
        assert isinstance(found, Saving) and found.basis == SavingBasis.SIMULATED, plan
        compared.append((plan, plan.saving_bytes, found.saving_bytes))
        print(f"{plan.units}: modelled {format_bytes(plan.saving_bytes)}, replayed {format_bytes(found.saving_bytes)}")
    for plan, model, replay in compared:
        assert abs(model - replay) <= max(TOLERANCE * replay, slack), (plan.units, model, replay)
    (advice,) = [item for item in modelled.advice if item.id == AdviceId.ACTIVATION_CHECKPOINTING] or [None]
    if not checkpointed:  # the trial's first advice: 36.0 MiB, modelled and replayed
        assert advice is not None and advice.saving_basis == SavingBasis.MODELLED
        assert abs(advice.estimated_saving_bytes - 36 * 2**20) <= TOLERANCE * 36 * 2**20
        assert abs(compared[0][2] - 36 * 2**20) <= TOLERANCE * 36 * 2**20
        return
    stem = next(saving for saving in compared if saving[0].units == (("stem",),))
    # The replay: the stem's BatchNorm input and statistics freed, its output kept, less the copy of its buffers kept
    # from forward for the recomputation (running mean and variance, 2 x 32 floats, and num_batches_tracked: 264 B).
    assert stem[2] == 4 * 2**20 + 256 - (2 * 32 * 4 + 8)
    # The console printed "Checkpoint `stem` to free about 8.0 MiB"; 4.0 MiB is under the rule's tenth of the peak.
    assert advice is None
