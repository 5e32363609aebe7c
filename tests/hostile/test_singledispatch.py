"""``functools.singledispatch`` functions and ``singledispatchmethod`` methods in the step.

Two findings: the implementations registered for a type (``@note.register``) were never walked, so the state they
change (a global list) grew with each replay; and a ``singledispatchmethod`` read as a class attribute through its
``__get__`` made a new function each time, which containment took for a change and set in the class: every later
training step then dispatched on the module itself and fell to the base implementation (a ``TypeError`` in training).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader

SEEN: list[int] = []


class Dispatching(Classifier):
    @functools.singledispatchmethod
    def record(self, value: object) -> None:
        raise TypeError(f"no record for {type(value).__name__}")

    @record.register
    def _(self, value: torch.Tensor) -> None:
        SEEN.append(value.dim())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.record(batch[0])
        return super().training_step(batch, batch_idx)


@functools.singledispatch
def note(value: object) -> None:
    raise TypeError(f"no note for {type(value).__name__}")


@note.register
def _(value: torch.Tensor) -> None:
    SEEN.append(value.dim())


class Noting(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        note(batch[0])
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model", [Dispatching, Noting])
def test_registered_implementations_are_walked_and_the_method_left_as_it_was(
    tmp_path: Path, path: str, model: type[Classifier]
) -> None:
    def build() -> Case:
        SEEN.clear()
        return Case(model(cnn_net()), loader(dataset_for("cnn"), batch_size=8), observe=lambda: list(SEEN))

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert isinstance(vars(Dispatching)["record"], functools.singledispatchmethod)
