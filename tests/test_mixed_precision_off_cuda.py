"""Mixed precision on the CPU: replayed, never advised, and the report says why beside the replayed figure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from advice_summaries import CPU, GPU, healthy_setup, healthy_summary
from models import Classifier, loader, trainer
from replay_models import images, resnet

from lightning_vram import VramMonitor
from lightning_vram.advice.rules.mixed_precision import NOT_ADVISED_OFF_CUDA, changes
from lightning_vram.records import PrecisionChange
from lightning_vram.render.text import markdown
from lightning_vram.units import format_bytes

# The replayed bf16 figure the report shows beside the reason.
pytestmark = pytest.mark.replay


def test_replayed_where_the_report_speaks_of_it() -> None:
    setup = healthy_setup(precision="32-true")
    assert changes(healthy_summary(), setup) == (PrecisionChange("bf16-mixed"),)  # CUDA: advised from it
    assert changes(healthy_summary(device=CPU), setup) == (PrecisionChange("bf16-mixed"),)  # CPU: said why not
    # A device the report says nothing of for mixed precision: nothing replayed for nothing.
    assert changes(healthy_summary(device=replace(GPU, type="mps", compute_capability=None)), setup) == ()
    assert changes(healthy_summary(device=CPU), healthy_setup(precision="bf16-mixed")) == ()


def test_a_cpu_run_is_told_why_the_lower_bf16_peak_is_not_advised(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(resnet()), loader(images(32), 8))
    report = monitor.report
    assert report is not None and report.simulation is not None and report.simulation.baseline is not None
    assert report.simulation.skipped is None
    baseline = report.simulation.baseline.reported_bytes(report.simulation.baseline.reported_peak)
    variant = next(item for item in report.simulation.variants if item.change == PrecisionChange("bf16-mixed"))
    assert variant.replayed is not None
    predicted = variant.replayed.reported_bytes(variant.replayed.reported_peak)
    assert predicted < 0.9 * baseline  # the replay lowers this resnet's counted peak (by about 44%)
    assert "mixed-precision" not in {item.id for item in report.advice}
    row = next(line for line in markdown(report).splitlines() if line.startswith('| precision="bf16-mixed"'))
    assert format_bytes(predicted) in row and f"-{format_bytes(baseline - predicted)}" in row
    assert row.endswith(f"replayed, peak in {variant.replayed.reported_peak.phase.value}; {NOT_ADVISED_OFF_CUDA} |")
