"""The no-trace guarantee on a real CUDA device: preflight and the in-training replay fake CUDA tensors there."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, assert_untouched
from models import BasicBlock, Classifier, dataset_for, loader
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@functools.lru_cache(maxsize=4)
def scale_table(channels: int, device: str) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, channels, device=device).view(1, channels, 1, 1)


class ResidualWithACache(Classifier):
    """A ResNet basic block (BatchNorm, inplace ReLU) whose step reads an ``lru_cache``d CUDA tensor."""

    def __init__(self, kept: list[torch.Tensor]) -> None:
        super().__init__(
            nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), BasicBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
            )
        )
        self.network[1].register_forward_hook(lambda _m, _i, output: kept.append(output.detach().sum()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        features = self.network[:2](inputs) * scale_table(8, str(inputs.device))
        return nn.functional.cross_entropy(self.network[2:](features), targets)


def test_training_on_a_gpu_is_bit_identical_with_the_monitor(tmp_path: Path) -> None:
    def build() -> Case:
        scale_table.cache_clear()
        kept: list[torch.Tensor] = []
        return Case(
            ResidualWithACache(kept),
            loader(dataset_for("cnn"), batch_size=16),
            observe=lambda: [tensor.cpu() for tensor in kept],
            trainer_options={"accelerator": "gpu", "deterministic": True},
        )

    monitor = assert_untouched(build, tmp_path, "cpu", steps=6)  # "cpu": no scripted probe; the device is real
    assert monitor.session.simulation is not None
