"""The micro-batch that fits and the accumulation that keeps the global batch (issue 26, item 3).

Where a GPU of the fit table does not hold the run's batch, its row gives the largest micro-batch that keeps the
run's global batch with ``accumulate_grad_batches`` (ceil), the report says it, preflight's smaller batch says it;
the row's plan is replayed (a window: the first micro-batch, a later one and the step) and served by the simulated
allocator at that GPU, and trained for real on the CPU its measured peaks are the predicted ones within 10%.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.advice.preflight import preflight
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import (
    AllocatorReading,
    BatchSizeChange,
    FitRow,
    Phase,
    PreflightVerdict,
    ReplayedStep,
    SavingBasis,
)
from lightning_vram.records.advice_json import fit_row_from_dict, fit_row_to_dict
from lightning_vram.render.text import fit_assumption, preflight_warning

pytestmark = pytest.mark.replay

MIB = 1024**2
BATCH = 32


def conv() -> nn.Module:
    """Activations of 8 MiB at a batch of 32 (16 channels of 64 x 64), next to small weights: they set the fit."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def batch_of(size: int) -> Any:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 3, 64, 64, generator=generator), torch.randint(0, 10, (size,), generator=generator)


def test_a_row_that_does_not_hold_the_batch_keeps_the_global_batch_and_round_trips() -> None:
    assert FitRow("A100", 80, 400).keeping(384, 1) == FitRow("A100", 80, 400)  # the batch fits: nothing to say
    assert FitRow("T4", 16, 100).keeping(96, 4).micro_batch_size is None  # the run's micro-batch of 96 fits
    row = FitRow("T4", 16, 100, SavingBasis.SIMULATED).keeping(128, 3)  # global 384, micro-batches of at most 100
    assert (row.micro_batch_size, row.accumulate_grad_batches, row.global_batch_size) == (96, 4, 384)
    assert row.accumulation_text == "micro-batch 96 with accumulate_grad_batches=4 (global batch 384, as now)"
    uneven = FitRow("T4", 16, 90).keeping(384, 1)  # ceil(384 / 90) = 5 micro-batches of ceil(384 / 5) = 77
    assert uneven.accumulation_text == "micro-batch 77 with accumulate_grad_batches=5 (global batch 385, the run's 384)"
    assert FitRow("T4", 16, 0).keeping(BATCH, 1).micro_batch_size is None  # nothing fits
    assert fit_row_from_dict(fit_row_to_dict(uneven), "fit[0]") == uneven
    assert "micro_batch_size" not in fit_row_to_dict(FitRow("A100", 80, 400))  # the JSON of 0.12's rows, unchanged
    assert fit_assumption([uneven]).endswith(
        " Where this run's batch does not fit: T4, micro-batch 77 with accumulate_grad_batches=5 (global batch 385,"
        " the run's 384)."
    )


def test_the_fit_rows_micro_batch_is_served_at_its_gpu_and_trained_at_its_accumulation_peaks_as_predicted(
    tmp_path: Path,
) -> None:
    settings = AllocatorSettings()
    torch.manual_seed(0)
    module = Classifier(conv(), OPTIMIZERS["adam"])
    predictor = Predictor(module, None, batch_of(BATCH), warm_up=True, allocator=settings)
    with round_of_replays():
        own = predictor.baseline()
        assert isinstance(own, ReplayedStep) and own.allocations is not None
        context = 64 * MIB
        half = predictor.batch_size(BATCH // 2)
        assert isinstance(half, ReplayedStep)
        capacity = context + (own.peak.peak_bytes + half.peak.peak_bytes) // 2  # 16 fits, 32 does not
        search = predictor.fit_table(context, gpus=[("small", capacity)], known_steps={BATCH: own})
    (found,) = search.found
    row = found.keeping(BATCH, 1)
    print(f"small GPU: largest batch {row.max_batch_size}; {row.accumulation_text}; note {row.note}")
    assert 0 < row.max_batch_size < BATCH
    micro, steps = row.micro_batch_size, row.accumulate_grad_batches
    assert micro is not None and steps is not None
    assert micro <= row.max_batch_size and steps == -(-BATCH // row.max_batch_size) and micro * steps >= BATCH
    # The plan replayed as Lightning runs it (a window's first micro-batch, a later one, the step): served there.
    planned = Predictor(module, None, batch_of(micro), warm_up=True, allocator=settings, accumulate=steps)
    with round_of_replays():
        plan = planned.baseline()
    assert isinstance(plan, ReplayedStep) and plan.allocations is not None and plan.window_first is not None
    assert serve(plan.allocations, settings, capacity - context).served
    # Trained for real at that micro-batch and accumulation: the sampled micro-batch (a window's last) as predicted.
    monitor = VramMonitor(attribution_start_step=2 * steps - 1, attribution_every_n_steps=None, console_summary=False)
    data = TensorDataset(*batch_of(micro * steps * 3))
    trainer(tmp_path, [monitor], max_steps=3, accumulate_grad_batches=steps).fit(module, loader(data, micro))
    report = monitor.report
    assert report is not None
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        measured, predicted = report.phases[phase], plan.phases[phase]
        assert measured.step == 2 * steps - 1
        print(f"{phase.value:9} measured {measured.peak_bytes:>10} predicted {predicted.peak_bytes:>10}")
        assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.1)


def test_preflights_smaller_batch_says_the_accumulation_that_keeps_the_global_batch() -> None:
    torch.manual_seed(0)
    predictor = Predictor(Classifier(conv(), OPTIMIZERS["adam"]), None, batch_of(BATCH), warm_up=True, accumulate=2)
    verdict = preflight(
        predictor,
        reading=AllocatorReading(0, 0, 0, 0),  # CPU replay: nothing allocated yet
        free_bytes=1 * MIB,  # nothing fits: every change is a remedy that saves memory
        changes=[BatchSizeChange(BATCH // 2)],
    )
    assert isinstance(verdict, PreflightVerdict) and not verdict.fits
    (remedy,) = verdict.remedies
    assert remedy.accumulation == "micro-batch 16 with accumulate_grad_batches=4 (global batch 64, as now)"
    assert ", as micro-batch 16 with accumulate_grad_batches=4 (global batch 64, as now)" in preflight_warning(
        verdict, "cuda:0"
    )


def test_preflights_smaller_batch_under_the_run_s_own_accumulation_names_no_lightning_setting() -> None:
    # Manual optimization, a plain or a Fabric loop: Lightning's accumulate_grad_batches does not apply there.
    torch.manual_seed(0)
    predictor = Predictor(Classifier(conv(), OPTIMIZERS["adam"]), None, batch_of(BATCH), warm_up=True)
    verdict = preflight(
        predictor,
        reading=AllocatorReading(0, 0, 0, 0),
        free_bytes=1 * MIB,
        changes=[BatchSizeChange(BATCH // 2)],
        own_accumulation=True,
    )
    assert isinstance(verdict, PreflightVerdict)
    (remedy,) = verdict.remedies
    assert remedy.accumulation == (
        "micro-batch 16, your code accumulating 2 per optimizer step, each loss divided by 2 (global batch 32, as now)"
    )
