"""A replay's warm-up made by arithmetic from a full one's record: the same figures as the full warm-up, to the byte.

Where the arithmetic would leave other tensors (a forward that keeps a tensor on the module), the replay runs again
with the full warm-up.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_vram.prediction.predictor as predictor_module
from lightning_vram.plan import plan
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.reserved import run_settings
from lightning_vram.prediction.replay.twin import Twin
from lightning_vram.prediction.replay.warm_start import WarmMismatchError, WarmStart, arithmetic_warm_up
from lightning_vram.records import ReplayedStep

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from quickstart import SmallCNN

pytestmark = pytest.mark.replay


class WithSpare(pl.LightningModule):
    """A layer trained, and a larger one never called: no gradient, so no Adam state."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 1000)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class Caching(WithSpare):
    """Its first forward keeps a tensor on the module, as a cache: the arithmetic warm-up would not make it."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if getattr(self, "cache", None) is None:
            self.cache = torch.ones(4096, device=batch.device)
        return self.layer(batch).square().mean() + self.cache.sum()


@pytest.fixture
def warm_ups(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The arithmetic warm-ups made and those that did not match, counted."""
    counts = {"made": 0, "mismatched": 0}

    def counted(twin: Twin, start: WarmStart) -> None:
        counts["made"] += 1
        try:
            arithmetic_warm_up(twin, start)
        except WarmMismatchError:
            counts["mismatched"] += 1
            raise

    monkeypatch.setattr(predictor_module, "arithmetic_warm_up", counted)
    return counts


def full_warm_ups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every warm-up run in full (the arithmetic one refused)."""

    def refused(twin: Twin, start: WarmStart) -> None:
        raise WarmMismatchError("refused by the test")

    monkeypatch.setattr(predictor_module, "arithmetic_warm_up", refused)


def replayed(module: nn.Module, batch: Any, starts: dict[str, WarmStart] | None) -> ReplayedStep:
    predictor = Predictor(module, None, batch, placement=torch.device("cpu"), warm_up=True, allocator=run_settings())
    predictor.warm_starts = starts
    step = predictor.replay(None, count_flops=True)
    assert isinstance(step, ReplayedStep)
    return dataclasses.replace(step, seconds=0.0)


@pytest.mark.parametrize(("module_class", "mismatched"), [(WithSpare, 0), (Caching, 1)])
def test_a_replay_warmed_up_by_arithmetic_counts_what_a_full_warm_up_counts(
    module_class: type[WithSpare], mismatched: int, warm_ups: dict[str, int]
) -> None:
    module = module_class()
    starts: dict[str, WarmStart] = {}
    replayed(module, torch.zeros(64, 16), starts)  # a full warm-up, recorded
    # The spare layer got no gradient in the full warm-up: the arithmetic one gives it none either.
    assert starts["32-true"].graded == frozenset({0, 1})
    assert warm_ups == {"made": 0, "mismatched": 0}
    by_arithmetic = replayed(module, torch.zeros(32, 16), starts)
    in_full = replayed(module, torch.zeros(32, 16), None)
    assert by_arithmetic == in_full
    assert warm_ups == {"made": 1, "mismatched": mismatched}
    assert not hasattr(module, "cache")  # the replays ran on copies


def test_a_plan_is_the_same_with_arithmetic_warm_ups(warm_ups: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    def quickstart_plan() -> dict[str, Any]:
        result = plan(
            SmallCNN(),
            (torch.zeros(64, 3, 32, 32), torch.zeros(64, dtype=torch.int64)),
            gpus=["T4", 600 * 2**20],  # a card of 600 MiB: smaller micro-batches, each a replay of its own
            world_sizes=(1, 2),
            strategies=("ddp", "fsdp"),
            budget_seconds=600,
        )
        assert result.left_out == ()
        figures = result.to_dict()
        figures.pop("seconds")
        return figures

    by_arithmetic = quickstart_plan()
    made = warm_ups["made"]
    assert made > 0
    full_warm_ups(monkeypatch)
    assert quickstart_plan() == by_arithmetic
