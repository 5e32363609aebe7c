"""A model with a method training never calls is replayed, and its advice simulated, as a user would see it.

Found by a new user's trial: their LightningModule had ``export`` (``torch.save`` of its state dict), which training
never calls; the walk took in every method of the model's classes, so every replay was refused ("may call
torch.save") and the checkpointing advice fell back to its modelled saving: 62.0 MiB promised, 47.5 MiB realised,
where a replay would have been right. A step that does call ``export`` is still refused, and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.records import SavingBasis

pytestmark = pytest.mark.replay

WIDTH, LENGTH, BATCH = 64, 64, 8


class Encoder(pl.LightningModule):
    """Four transformer encoder blocks over a sequence, mean-pooled into a classifier.

    ``on_train_start`` writes a log and ``export`` saves the weights: neither runs in a training batch.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(4)
        )
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, features: Tensor) -> Tensor:
        hidden = self.embed(features)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden.mean(1))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        features, labels = batch
        return nn.functional.cross_entropy(self(features), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def on_train_start(self) -> None:
        """Log the start of training (Lightning calls it once, before the first batch)."""
        with open(self.folder / "started.txt", "a") as log:
            log.write(f"{sum(parameter.numel() for parameter in self.parameters())} parameters\n")

    def export(self, name: str) -> None:
        """Save the weights for serving (the user calls it after training)."""
        torch.save(self.state_dict(), self.folder / name)


class ExportsInTheStep(Encoder):
    """Calls ``export`` from its training step (every 1,000 steps): a replay would write the file again."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx % 1000 == 999:
            self.export(f"step-{batch_idx}.pt")
        return super().training_step(batch, batch_idx)


def features(samples: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, LENGTH, 16, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    return DataLoader(data, batch_size=BATCH)


def monitored(root: Path, module: pl.LightningModule) -> VramMonitor:
    """Three steps, step 1 counted and replayed in training (the report's own advice)."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, features(4 * BATCH))
    return monitor


def test_a_method_training_never_calls_leaves_the_step_replayed_and_its_advice_simulated(tmp_path: Path) -> None:
    folder = tmp_path / "exports"
    folder.mkdir()
    monitor = monitored(tmp_path / "run", Encoder(folder))
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert simulation.baseline is not None
    report = monitor.report
    assert report is not None
    checkpointing = next((advice for advice in report.advice if advice.id == "activation-checkpointing"), None)
    assert checkpointing is not None, [advice.id for advice in report.advice]
    print(f"checkpointing: {checkpointing.estimated_saving_bytes} bytes, {checkpointing.saving_basis}")
    assert checkpointing.saving_basis is SavingBasis.SIMULATED, checkpointing.evidence
    modelled = [advice.id.value for advice in report.advice if advice.saving_basis is SavingBasis.MODELLED]
    assert modelled in ([], ["optimizer-state"])  # the one rule that declares no change to replay
    assert [file.name for file in folder.iterdir()] == ["started.txt"]  # no export: not training's, not a replay's
    assert (folder / "started.txt").read_text().count("\n") == 1  # Lightning's call, not a replay's


def test_a_step_that_calls_the_method_is_still_refused_with_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "exports"
    folder.mkdir()
    monitor = monitored(tmp_path / "run", ExportsInTheStep(folder))
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None
    # what the step does, not on_train_start's log (defined first: the walk of every method named that one)
    assert "Encoder.export may call torch.save (a file it writes would be written again)" in simulation.skipped
    assert "a replay would do it again" in simulation.skipped
    report = monitor.report
    assert report is not None
    assert all(advice.saving_basis is not SavingBasis.SIMULATED for advice in report.advice)
    assert [file.name for file in folder.iterdir()] == ["started.txt"]
