"""Under gradient accumulation, a stronger sharding's saving starts from a measured peak only of the micro-batch the
prediction is of (the window's stepping one): a new user's trial's DDP run sampled a window's first micro-batch,
25.5 MiB with no gradient held yet, and its advice started there where the run's peak, the window's second, was
27.0 MiB."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import OPTIMIZERS, REPLAYS_OFF, Classifier, dataset_for, loader, mlp, trainer

from lightning_vram import VramMonitor
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies.stronger import measured_peak
from lightning_vram.records import Attribution


class StopAfter(pl.Callback):
    """Stops the run once batch ``step`` has ended (after the monitor's hook): its count is the last."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.step:
            trainer.should_stop = True


def sampled(root: Path, step: int) -> tuple[Classifier, Attribution, torch.Tensor]:
    """Batch ``step`` of a run accumulating 2 micro-batches counted, the run stopped after it: the module, its
    counts, one batch."""
    torch.manual_seed(0)
    module = Classifier(mlp(32, 3), OPTIMIZERS["adam"])
    monitor = VramMonitor(
        attribution_start_step=step, attribution_every_n_steps=None, console_summary=False, **REPLAYS_OFF
    )
    batches = loader(dataset_for("linear"), 8)
    trainer(root, [monitor, StopAfter(step)], max_steps=2, accumulate_grad_batches=2).fit(module, batches)
    attribution = monitor.session._recorder.tracker.latest_attribution
    assert attribution is not None
    return module, attribution, next(iter(batches))


@pytest.mark.parametrize(("step", "place"), [(2, 1), (3, 2)])
def test_the_saving_starts_from_the_sampled_peak_only_of_the_stepping_micro_batch(
    tmp_path: Path, step: int, place: int
) -> None:
    module, attribution, batch = sampled(tmp_path, step)
    assert attribution.micro_batch == place
    predictor = Predictor(module, None, batch, accumulate=2, calibration=attribution)
    peak = max(part.peak_bytes for part in attribution.phases.values())
    assert measured_peak(predictor) == (peak if place == 2 else None)
    assert measured_peak(Predictor(module, None, batch, calibration=attribution)) == peak  # not accumulating
