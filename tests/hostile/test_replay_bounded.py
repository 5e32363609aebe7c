"""Every replay stops at its deadline (checked op by op); the batch search stops at its bound and says "at least"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, dataset_for, linear_net, loader
from torch import nn

from lightning_vram import predict
from lightning_vram.prediction.containment import deadline as deadline_module
from lightning_vram.prediction.containment.deadline import Deadline, ReplayDeadlineError
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay._fake import FakeTensorMode
from lightning_vram.prediction.replay.search import MAX_BATCH_SIZE


class PerSample(Classifier):
    """A training step that loops over the batch's samples: its replay's cost grows with the batch size."""

    def __init__(self) -> None:
        super().__init__(linear_net())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        losses = [nn.functional.cross_entropy(self(inputs[i : i + 1]), targets[i : i + 1]) for i in range(len(inputs))]
        return torch.stack(losses).mean()


def test_the_deadline_stops_a_replay_at_the_first_op_past_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.5, 1.5, 2.0])
    monkeypatch.setattr(deadline_module.time, "perf_counter", lambda: next(clock))
    ran: list[int] = []

    def ten_additions() -> None:
        x = torch.ones(4)
        for index in range(10):
            x = x + 1
            ran.append(index)

    with FakeTensorMode(), Deadline(at=1.0), pytest.raises(ReplayDeadlineError, match="time budget ran out"):
        ten_additions()
    assert ran == [0]  # the ops at 0.0 (ones) and 0.5 ran; the third, at 1.5, raised


def test_predict_stops_within_its_budget_and_says_what_the_budget_left_out() -> None:
    batch = (torch.randn(64, 32), torch.randint(0, 10, (64,)))
    prediction = predict(PerSample(), batch, device_type="cpu", budget_seconds=0.2)
    if prediction.skipped is not None:  # the budget ran out in the first replay already (a slow, loaded machine)
        assert "time budget" in prediction.skipped
    else:
        assert prediction.fit == ()
        assert any("time budget" in note for note in prediction.notes)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "10", True])
def test_predict_refuses_a_budget_that_is_not_a_positive_number(bad: Any) -> None:
    with pytest.raises(ValueError, match="budget_seconds must be a number of seconds > 0"):
        predict(PerSample(), (torch.randn(2, 32), torch.randint(0, 10, (2,))), device_type="cpu", budget_seconds=bad)


@pytest.mark.parametrize("path", PATHS)
def test_a_per_sample_loop_trains_untouched_under_a_short_replay_budget(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        return Case(PerSample(), loader(dataset_for("linear"), batch_size=32))

    monitor = assert_untouched(build, tmp_path, path, replay_budget_seconds=0.5)
    assert monitor.report is not None


class Constant(Classifier):
    """A step whose peak does not grow with the batch: every batch size fits, up to the search's bound."""

    def __init__(self) -> None:
        super().__init__(linear_net())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.network[0].weight.square().sum()


def test_a_search_that_reaches_its_bound_reports_at_least() -> None:
    module = Constant()
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    rows = Predictor(module, None, batch, warm_up=True).fit_table(0, gpus=(("big", 1 << 40),)).found
    assert len(rows) == 1
    assert rows[0].max_batch_size == MAX_BATCH_SIZE and rows[0].at_least
    assert rows[0].batch_text == f"at least {MAX_BATCH_SIZE}"
