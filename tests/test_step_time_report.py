"""The report's simulated advice carries the step time predicted with its change, calibrated by the run's own step.

A ResNet-style CNN trained with the monitor on the CPU: its checkpointing advice's ``predicted_step_seconds`` is the
run's measured median step time times the replayed change's predicted time over the baseline's (both replayed
again here, priced with the same measured CPU), and it is written to the report's JSON and read back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from advice_models import ResNetStyle, images
from models import Classifier, loader
from test_checkpointing_same_model import advised, report_of

from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.timing import measure_host_peaks, predict_step_time
from lightning_vram.records import CheckpointChange, ReplayedStep

pytestmark = pytest.mark.replay  # the advice comes from the replay

BATCH = 32


def test_the_checkpointing_advice_predicts_its_step_time_calibrated_by_the_run(tmp_path: Path) -> None:
    dataset = images(BATCH * 6)
    torch.manual_seed(1)
    report = report_of(tmp_path, Classifier(ResNetStyle()), dataset, BATCH)
    advice, plan, _ = advised(report)
    measured = report.timing.step_seconds_median
    assert measured is not None
    assert advice.predicted_step_seconds is not None
    torch.manual_seed(1)
    module = Classifier(ResNetStyle())
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    predictor = Predictor(module, [optimizer], next(iter(loader(dataset, BATCH))))
    baseline = predictor.replay(None, count_flops=True)
    checkpointed = predictor.replay(CheckpointChange(plan), count_flops=True)
    assert isinstance(baseline, ReplayedStep)
    assert isinstance(checkpointed, ReplayedStep)
    peaks = measure_host_peaks()  # what the monitor priced with: measured once in this process
    ratio = predict_step_time(checkpointed, peaks).seconds / predict_step_time(baseline, peaks).seconds
    print(f"measured {1000 * measured:.1f} ms a step; with checkpointing {1000 * advice.predicted_step_seconds:.1f}")
    assert ratio > 1  # the recomputed forward
    assert advice.predicted_step_seconds == pytest.approx(measured * ratio, rel=1e-9)
    again = report_from_dict(report_to_dict(report))
    (read,) = [item for item in again.advice if item.id is advice.id]
    assert read.predicted_step_seconds == advice.predicted_step_seconds
