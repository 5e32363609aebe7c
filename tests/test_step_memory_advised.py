"""The figure of the step's memory draws the advised change's replay, where two changes replay to the same peak.

A new user's trial: a ResNet's `layers` checkpointed in 3 and in 4 segments replay to the same peak; the advice printed
3 segments (it recomputes less), the figure's panel said "advised: checkpoint layers in 4 segments" (the first variant
with the advice's peak). The advice now names its replayed change (``replayed_change``), which the figure, the
report's JSON timeline and a report read back follow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from advice_models import images
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import nn

from lightning_vram import Report, VramMonitor
from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.records import CheckpointChange, advised_variant
from lightning_vram.render.step_memory import step_memory_figure

pytestmark = pytest.mark.replay  # the variants compared are the run's replayed ones


class Block(nn.Module):
    """A basic residual block, BatchNorm and an inplace ReLU, a projection where the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        same = stride == 1 and inputs == outputs
        projection = [nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)]
        self.short = nn.Sequential() if same else nn.Sequential(*projection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + self.short(x))  # type: ignore[no-any-return]


class Net(nn.Module):
    """A stem and four blocks in one ``nn.Sequential``: its last segment frees nothing at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(Block(32, 32), Block(32, 64, 2), Block(64, 64), Block(64, 128, 2))
        self.fc = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path_factory.mktemp("run"), [monitor], max_steps=3).fit(
        Classifier(Net(), OPTIMIZERS["sgd_momentum"]), loader(images(96, size=32), 32)
    )
    assert monitor.report is not None and monitor.report.simulation is not None
    return monitor.report


def test_the_advice_names_its_own_replayed_change_among_those_with_its_peak(report: Report) -> None:
    advice = next(item for item in report.advice if item.id == "activation-checkpointing")
    assert report.simulation is not None
    same_peak = [
        variant.change.label
        for variant in report.simulation.variants
        if isinstance(variant.change, CheckpointChange)
        and variant.replayed is not None
        and variant.replayed.reported_bytes(variant.replayed.reported_peak) == advice.predicted_peak_bytes
    ]
    # The case: another plan, earlier in the simulation's order, replays to the advice's peak.
    assert len(same_peak) == 2 and same_peak[0] != advice.replayed_change, (same_peak, advice.replayed_change)
    assert advice.replayed_change == "checkpoint network.layers in 3 segments"
    assert "in 3 segments" in advice.title
    variant = advised_variant(report.simulation, report.advice)
    assert variant is not None and variant.change.label == advice.replayed_change


def test_the_figure_and_the_report_read_back_draw_the_advised_change(report: Report) -> None:
    advice = next(item for item in report.advice if item.id == "activation-checkpointing")
    figure = step_memory_figure(report)
    assert figure is not None
    assert figure.axes[1].get_title().startswith(f"advised: {advice.replayed_change}\n")
    data = report_to_dict(report)
    drawn = [entry["change"] for entry in data["simulation"]["variants"] if entry.get("timeline") is not None]
    assert drawn == [advice.replayed_change]
    back = report_from_dict(data)
    assert [item.replayed_change for item in back.advice] == [item.replayed_change for item in report.advice]
    variant = advised_variant(back.simulation, back.advice)
    assert variant is not None and variant.change.label == advice.replayed_change
