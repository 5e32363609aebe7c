"""A checkpointing plan's stand-ins keep nothing of the replay: each unit's calls and the links it hands on are
emptied as the replay ends. Their outputs are fake tensors whose graph reaches the copy through autograd's C++, a
cycle the garbage collector cannot see: once the stand-ins were left out of the walk that puts back what the copy's
modules hold, nothing emptied them, and a ResNet-50-style network's plans left 218 fake tensors held; the escape
check turned the run's replays off (the GPU check's CPU dry run lost its ResNet rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor

pytestmark = pytest.mark.replay


class Bottleneck(nn.Module):
    """torchvision's layout: 1x1, 3x3, 1x1 convolutions with BatchNorm and inplace ReLU, a shortcut added back."""

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * 4
        self.body = nn.Sequential(
            nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(inplace=True),
            nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out),
        )  # fmt: skip
        self.shortcut = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> Any:
        return self.relu(self.body(x) + self.shortcut(x))


def test_a_bottleneck_resnet_s_plans_leave_its_replays_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    network = nn.Sequential(
        nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        Bottleneck(8, 8, 1), Bottleneck(32, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(6, 3, 64, 64, generator=generator), torch.randint(0, 10, (6,), generator=generator)
    )
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(network, OPTIMIZERS["sgd"]), loader(data, 2))
    report = monitor.report
    assert report is not None
    assert [item.reason for item in report.not_measured if item.what == "step replay"] == []
    assert report.simulation is not None and report.simulation.baseline is not None
    assert report.simulation.variants  # the plans were replayed too
