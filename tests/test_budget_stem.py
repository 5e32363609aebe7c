"""A memory budget only a stem checkpointed with the stages' blocks meets: the search finds that plan.

A user's CNN in plain torch: a stem (a convolution taking the raw batch, BatchNorm, an inplace ReLU: as
``self.stem = nn.Sequential(...)`` or as top-level modules, torchvision's layout), three stages of residual blocks
with BatchNorm and inplace ReLUs, pooling and a head. With every
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
from models import BasicBlock, Classifier
from test_memory_budget import check_plan_within, first_batch, measured_peak
from torch import nn

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import CheckpointChange, CheckpointPlan, ReplayedStep, ReplaySkipped

pytestmark = pytest.mark.replay  # predict() replays


class StemNet(nn.Module):
    """A stem, three stages of two blocks, global pooling and a linear head.

    ``sequential``: the stem is ``self.stem``, an ``nn.Sequential``; else its modules are the model's own.
    """

    def __init__(self, sequential: bool, width: int = 8) -> None:
        super().__init__()
        stem = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        self.stem = nn.Sequential(*stem) if sequential else None
        if not sequential:
            self.conv1, self.bn1, self.relu = stem
        self.layer1 = nn.Sequential(BasicBlock(width), BasicBlock(width))
        self.layer2 = nn.Sequential(BasicBlock(width), BasicBlock(width))
        self.layer3 = nn.Sequential(BasicBlock(width), BasicBlock(width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.stem(inputs) if self.stem is not None else self.relu(self.bn1(self.conv1(inputs)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))  # type: ignore[no-any-return]


BLOCKS = tuple((f"network.layer{stage}.{block}",) for stage in (1, 2, 3) for block in (0, 1))
STEMS = {True: ("network.stem",), False: ("network.conv1", "network.bn1", "network.relu")}


def by_hand(tmp_path: Path, sequential: bool, units: tuple[tuple[str, ...], ...]) -> int:
    """The measured live peak with ``units`` checkpointed by hand."""
    torch.manual_seed(1)
    module = Classifier(StemNet(sequential))
    apply_plan(module, CheckpointPlan("network", units, None, 0))
    return measured_peak(tmp_path, module, images(6 * 32), 32)


@pytest.mark.parametrize("sequential", [True, False], ids=["self.stem", "top-level stem"])
def test_a_budget_only_the_stem_with_the_blocks_meets_is_met(tmp_path: Path, sequential: bool) -> None:
    blocks = by_hand(tmp_path / "blocks", sequential, BLOCKS)
    with_stem = by_hand(tmp_path / "stem", sequential, (STEMS[sequential], *BLOCKS))
    print(f"measured: every block {blocks:,} B, the stem and every block {with_stem:,} B")
    assert with_stem < blocks
    budget = (blocks + with_stem) // 2
    # Main's search: "no plan fits: the smallest peak the search reached is 3.4 MiB live, checkpointing 6 unit(s)".
    make = lambda: Classifier(StemNet(sequential))  # noqa: E731
    found = check_plan_within(tmp_path / "plan", "stem", make, images(6 * 32), 32, budget)
    assert found.plan is not None and STEMS[sequential] in found.plan.units, found.plan


class Scaled(StemNet):
    """The top-level stem with an op between its convolution and its BatchNorm: not a chain of modules."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(inputs) * 2))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))  # type: ignore[no-any-return]


def test_a_stem_whose_modules_are_not_a_chain_is_not_replayed_as_one_unit() -> None:
    """Checkpointed as one unit, its modules would run without the ``* 2``: another model. The replay refuses."""
    torch.manual_seed(1)
    predictor = Predictor(Classifier(Scaled(False)), None, first_batch(images(32), 32), placement=torch.device("cpu"))
    skipped = predictor.replay(CheckpointChange(CheckpointPlan("network", (STEMS[False],), None, 0, "network")))
    assert isinstance(skipped, ReplaySkipped)
    assert "on the output of the module before it, which its caller does not pass it" in skipped.reason
    chain = Predictor(Classifier(StemNet(False)), None, first_batch(images(32), 32), placement=torch.device("cpu"))
    assert isinstance(chain.replay(CheckpointChange(CheckpointPlan("network", (STEMS[False],), None, 0))), ReplayedStep)


class Reuses(StemNet):
    """An attack's: the stem's convolution output used twice, once by its BatchNorm, once added back after its ReLU.

    Each module still takes the output of the one before it; the unit's modules are a chain, but the caller uses an
    output from inside the unit too: checkpointed as one unit, ``c`` would be the unit's output, another model.
    """

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        c = self.conv1(inputs)
        x = self.relu(self.bn1(c)) + c
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))  # type: ignore[no-any-return]


def test_a_stem_whose_caller_uses_an_output_from_inside_the_unit_is_not_replayed_as_one_unit() -> None:
    torch.manual_seed(1)
    predictor = Predictor(Classifier(Reuses(False)), None, first_batch(images(32), 32), placement=torch.device("cpu"))
    skipped = predictor.replay(CheckpointChange(CheckpointPlan("network", (STEMS[False],), None, 0, "network")))
    assert isinstance(skipped, ReplaySkipped), "a plan that would train another model was replayed"
