"""An out-of-memory error after preflight warned: the diagnosis carries the remedies preflight replayed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Classifier, dataset_for, loader, trainer
from test_oom import FailsAt, gpu_boundaries

from lightning_vram import VramMonitor
from lightning_vram.records import AdviceId, SavingBasis
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe
from lightning_vram.units import format_bytes

pytestmark = pytest.mark.replay  # preflight's replayed remedies


class FailsForReal(FailsAt):
    """Runs out of memory in the forward pass of step 0, for real only: preflight's replay of that step goes through."""

    def __init__(self) -> None:
        super().__init__("forward", batch=0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if torch._subclasses.fake_tensor.is_fake(batch[0]):
            return Classifier.training_step(self, batch, batch_idx)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)  # not FailsAt's, whose step reaches the module


def test_an_oom_at_step_0_after_a_preflight_warning_lists_its_replayed_remedies(tmp_path: Path) -> None:
    # Nothing allocated before step 0 and 1 KiB free: preflight warns and replays its remedies; then the step fails.
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0), *gpu_boundaries()], free_bytes=1024)
    monitor = VramMonitor(probe=probe, console_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.cuda.OutOfMemoryError):
            trainer(tmp_path, [monitor], max_steps=4).fit(FailsForReal(), loader(dataset_for("linear")))
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and not verdict.fits and verdict.remedies
    diagnosis = monitor.oom_diagnosis
    assert diagnosis is not None and diagnosis.step == 0
    near = next(item for item in diagnosis.advice if item.id == AdviceId.NEAR_CAPACITY)
    assert "none measured" not in near.detail
    peak = verdict.step.peak.peak_bytes
    for remedy in verdict.remedies:  # each with its replayed figures
        assert (
            f"{remedy.label}: peak {format_bytes(remedy.peak_bytes)}, {format_bytes(peak - remedy.peak_bytes)} below"
            f" the step's {format_bytes(peak)} (does not fit, simulated)" in near.detail
        )
    assert "replayed by preflight before step 0" in near.detail
    best = min(verdict.remedies, key=lambda remedy: remedy.peak_bytes)
    if near.saving_basis is SavingBasis.SIMULATED:
        assert (near.estimated_saving_bytes, near.predicted_peak_bytes) == (peak - best.peak_bytes, best.peak_bytes)
    markdown = (tmp_path / "vram_oom_report.md").read_text()
    assert "replayed by preflight before step 0" in markdown


def test_an_oom_without_a_preflight_warning_says_nothing_of_preflight(tmp_path: Path) -> None:
    monitor = VramMonitor(probe=ScriptedProbe(gpu_boundaries()), console_summary=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer(tmp_path, [monitor], max_steps=4).fit(FailsForReal(), loader(dataset_for("linear")))
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and verdict.fits  # 12 GiB allocated already covers the replayed step
    diagnosis = monitor.oom_diagnosis
    assert diagnosis is not None
    assert all("preflight" not in item.detail for item in diagnosis.advice)
    assert all("preflight" not in note for note in diagnosis.notes)
