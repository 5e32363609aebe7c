"""A memory budget only a stem checkpointed with the stages' blocks meets: the search finds that plan.

A user's CNN in plain torch: a stem (``self.stem = nn.Sequential(conv, BatchNorm, inplace ReLU)``, its convolution
taking the raw batch), three stages of residual blocks with BatchNorm and inplace ReLUs, pooling and a head. With every
block of every stage checkpointed (applied by hand, ``torch.utils.checkpoint`` through the advice's
``checkpoint_keeping_buffers``) the measured live peak stays above the budget; with the stem checkpointed too it is
under it. The search said "no plan fits" there (the stem is not in the stages' containers); the plan it gives now is
applied as printed: it fits as predicted and trains the same model (BatchNorm's running statistics included).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from advice_models import apply_plan, images
from models import Classifier
from test_memory_budget import check_plan_within, measured_peak
from torch import nn

from lightning_vram.records import CheckpointPlan

pytestmark = pytest.mark.replay  # predict() replays


class Block(nn.Module):
    """Two 3x3 convolutions with BatchNorm, an inplace ReLU after the first and after the input is added back."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(inputs)))
        return self.relu(self.bn2(self.conv2(out)) + inputs)  # type: ignore[no-any-return]


class StemNet(nn.Module):
    """A stem, three stages of two blocks, global pooling and a linear head."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        self.layer1 = nn.Sequential(Block(width), Block(width))
        self.layer2 = nn.Sequential(Block(width), Block(width))
        self.layer3 = nn.Sequential(Block(width), Block(width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(inputs))))
        return self.fc(torch.flatten(self.pool(x), 1))  # type: ignore[no-any-return]


BLOCKS = tuple((f"network.layer{stage}.{block}",) for stage in (1, 2, 3) for block in (0, 1))


def by_hand(tmp_path: Path, units: tuple[tuple[str, ...], ...]) -> int:
    """The measured live peak with ``units`` checkpointed by hand."""
    torch.manual_seed(1)
    module = Classifier(StemNet())
    apply_plan(module, CheckpointPlan("network", units, None, 0))
    return measured_peak(tmp_path, module, images(6 * 32), 32)


def test_a_budget_only_the_stem_with_the_blocks_meets_is_met(tmp_path: Path) -> None:
    blocks = by_hand(tmp_path / "blocks", BLOCKS)
    with_stem = by_hand(tmp_path / "stem", (("network.stem",), *BLOCKS))
    print(f"measured: every block {blocks:,} B, the stem and every block {with_stem:,} B")
    assert with_stem < blocks
    budget = (blocks + with_stem) // 2
    # Main's search: "no plan fits: the smallest peak the search reached is 3.4 MiB live, checkpointing 6 unit(s)".
    found = check_plan_within(tmp_path / "plan", "stem", lambda: Classifier(StemNet()), images(6 * 32), 32, budget)
    assert found.plan is not None and ("network.stem",) in found.plan.units, found.plan
