"""A ``ContextVar`` with no value before a replay, set by the user's forward (issue 25, low).

The replay runs the forward a second time; a variable it sets must not stay set after it. A variable that had no
value cannot be unset with ``ContextVar`` methods, so the replay runs in a copy of the context.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader
from torch import nn

COUNTER_VAR: contextvars.ContextVar[int] = contextvars.ContextVar("hostile_forward_calls")
"""Rebound to a fresh variable (no value, no default) for each run."""


class CountsForwardCalls(Classifier):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        COUNTER_VAR.set(COUNTER_VAR.get(0) + 1)
        return self.network(inputs)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        outputs = self(inputs)
        return nn.functional.cross_entropy(outputs * (1.0 + 0.25 * COUNTER_VAR.get()), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_context_variable_unset_before_fit_is_left_unset_by_replays(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global COUNTER_VAR
        COUNTER_VAR = contextvars.ContextVar("hostile_forward_calls")
        variable = COUNTER_VAR
        return Case(
            CountsForwardCalls(cnn_net()), loader(dataset_for("cnn"), batch_size=8), observe=lambda: variable.get(None)
        )

    monitor = assert_untouched(build, tmp_path, path)
    assert COUNTER_VAR.get(None) == 4  # one forward per step, four steps: the replays' forwards counted nowhere
    report = monitor.report
    assert report is not None
    assert report.simulation is not None  # replays ran (and were not turned off by a containment error)


HISTORY_VAR: contextvars.ContextVar[list[int]] = contextvars.ContextVar("hostile_history")


class AppendsToAContextVarsList(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        history = HISTORY_VAR.get()
        history.append(batch_idx)
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs) * (1.0 + 0.25 * len(history)), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_list_a_context_variable_holds_is_put_back(tmp_path: Path, path: str) -> None:
    """The copy of the context shares the objects its variables hold: the list is saved like any other."""

    def build() -> Case:
        history: list[int] = []
        HISTORY_VAR.set(history)
        return Case(
            AppendsToAContextVarsList(cnn_net()),
            loader(dataset_for("cnn"), batch_size=8),
            observe=lambda: list(history),
        )

    assert_untouched(build, tmp_path, path)
