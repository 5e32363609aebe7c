"""Users of the standalone ``pytorch_lightning`` package get the same monitor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from models import FLOAT32, PARAMETER_COUNTS, cnn_net, dataset_for, loader
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_vram.pytorch_lightning import VramMonitor
from lightning_vram.records import Phase
from lightning_vram.render.tensorboard import FIGURE_TAGS, MONITOR_RUN


class ClassicModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.network = cnn_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self.network(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


@pytest.mark.figures
def test_pytorch_lightning_trainer(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    logger = TensorBoardLogger(tmp_path, name="classic")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(ClassicModule(), loader(dataset_for("cnn")))
    report = monitor.report
    assert report is not None and report.steps == 3
    breakdown = report.phases[Phase.FORWARD].breakdown
    assert breakdown is not None
    parameter_bytes = PARAMETER_COUNTS["cnn"] * FLOAT32
    assert (breakdown.parameters, breakdown.optimizer_state) == (parameter_bytes, parameter_bytes)
    assert monitor.report_path == Path(logger.log_dir) / "vram_report.json"
    events = EventAccumulator(str(Path(logger.log_dir) / MONITOR_RUN))  # the monitor's own run
    events.Reload()
    assert set(FIGURE_TAGS) <= set(events.Tags()["images"])
