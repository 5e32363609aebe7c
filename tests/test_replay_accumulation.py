"""Gradient accumulation replayed (issue 26, item 3): a window's micro-batches as Lightning runs them.

0.11.0 skipped the replay of any run with ``accumulate_grad_batches > 1`` ("the replay runs one optimizer step per
batch"): its advice stayed modelled. The replay now runs the window's first micro-batch (its gradients set to None
before backward) and a later one with the optimizer step; a sampled micro-batch matches the one of its place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import OPTIMIZERS, Classifier, dataset_for, loader, trainer
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.codec import report_from_dict
from lightning_vram.records import COUNTED_PARTS, Phase, SavingBasis
from lightning_vram.render.html import render_html
from lightning_vram.render.simulation import simulation_view
from lightning_vram.render.text import summary_text
from lightning_vram.units import format_bytes

pytestmark = pytest.mark.replay


def deep_cnn() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def accumulated(tmp_path: Path, sampled: int) -> VramMonitor:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=sampled, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3, accumulate_grad_batches=4).fit(
        Classifier(deep_cnn(), OPTIMIZERS["adam"]), loader(dataset_for("cnn"), batch_size=16)
    )
    return monitor


@pytest.mark.parametrize(("sampled", "place"), [(4, "first"), (5, "later"), (7, "last")])
def test_a_sampled_micro_batch_matches_the_replayed_one_of_its_place_and_advice_is_simulated(
    tmp_path: Path, sampled: int, place: str
) -> None:
    monitor = accumulated(tmp_path, sampled)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None
    match, baseline = simulation.match, simulation.baseline
    assert match is not None and match.matches and match.step == sampled
    assert baseline is not None and baseline.window_first is not None
    for part in match.parts:
        print(f"{place} {part.phase.value:9} {part.part:16} {part.measured_bytes:8} {part.replayed_bytes:8}")
        assert part.relative_error <= match.tolerance
    phases = {part.phase for part in match.parts}
    assert phases == (
        {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER} if place == "last" else {Phase.FORWARD, Phase.BACKWARD}
    )
    compared = baseline.window_first if place == "first" else baseline.phases
    for part in match.parts:
        if part.part in COUNTED_PARTS:
            breakdown = compared[part.phase].breakdown
            assert breakdown is not None and getattr(breakdown, part.part) == part.replayed_bytes
    # The later micro-batch's backward adds to the gradients the first left: it holds more, and is the steady figure.
    first_backward, steady_backward = baseline.window_first[Phase.BACKWARD], baseline.phases[Phase.BACKWARD]
    assert steady_backward.peak_bytes > first_backward.peak_bytes
    assert first_backward.breakdown is not None and steady_backward.breakdown is not None
    assert first_backward.breakdown.gradients < steady_backward.breakdown.gradients == 40104
    report = monitor.report
    assert report is not None and report.advice
    assert {advice.saving_basis for advice in report.advice if advice.estimated_saving_bytes} == {SavingBasis.SIMULATED}


def test_no_micro_batch_before_the_first_optimizer_step_is_replayed(tmp_path: Path) -> None:
    monitor = accumulated(tmp_path, 2)  # the window's third micro-batch: no optimizer state exists yet
    assert monitor.session.simulation is None
    assert monitor.report is not None and monitor.report.simulation is None


def test_the_report_shows_the_first_micro_batch_it_matched_and_says_the_advice_is_the_steady_one(
    tmp_path: Path,
) -> None:
    # A new user's report (issue 26 polish): sampled step 4 is a window's first micro-batch, matched against the
    # replayed first micro-batch, but the table showed the steady micro-batch beside it (backward 138.0 counted
    # against 145.1 replayed "within 1%") and an optimizer row measured 0 B.
    monitor = accumulated(tmp_path, 4)
    report = monitor.report
    assert report is not None and report.simulation is not None
    match, baseline = report.simulation.match, report.simulation.baseline
    assert match is not None and match.window_first and baseline is not None and baseline.window_first is not None
    assert report.simulation.accumulate_grad_batches == 4
    view = simulation_view(report)
    assert view is not None and view.baseline is not None
    rows = {row[0]: row for row in view.baseline.rows}
    assert set(rows) == {"forward (first micro-batch)", "backward (first micro-batch)"}
    for phase, row in zip((Phase.FORWARD, Phase.BACKWARD), rows.values(), strict=True):
        first = baseline.window_first[phase]
        assert first.breakdown is not None
        assert row[2] == format_bytes(first.breakdown.counted_bytes) == row[1]
        assert row[3] == "none"
        assert row[5] == format_bytes(first.peak_bytes) == row[4]
    steady = baseline.phases[Phase.BACKWARD].breakdown
    assert steady is not None and format_bytes(steady.counted_bytes) not in rows["backward (first micro-batch)"]
    assert "accumulate_grad_batches=4: sampled step 4 is the first micro-batch of its window" in view.summary
    assert "the advice's figures are the steady micro-batch's" in view.summary
    html = render_html(report)
    assert "backward (first micro-batch)" in html and "accumulate_grad_batches=4" in html
    # The window's stepping micro-batch, step 7, is sampled too: the report's peaks are measured holding the window's
    # gradients, and its optimizer phase is there.
    summary = summary_text(report, width=400)
    assert report.peak is not None and (report.peak.step, report.peak.micro_batch) == (7, 4)
    assert report.phases[Phase.OPTIMIZER].step == 7 and "no optimizer entry" not in summary
    assert "of step 7 (micro-batch 4 of 4, which steps the optimizer)" in summary
    read_back = report_from_dict(report.to_dict())
    assert read_back.simulation is not None and read_back.simulation.accumulate_grad_batches == 4
    again = simulation_view(read_back)
    assert again is not None and again.baseline is not None
    assert again.baseline.rows == view.baseline.rows and again.summary == view.summary
