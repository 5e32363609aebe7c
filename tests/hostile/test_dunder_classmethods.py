"""Dunder methods Python makes classmethods by itself: ``__class_getitem__`` and ``__init_subclass__``.

The walk skipped a class's dunder attributes that are not callable (``__module__``, ``__doc__``), and a
``classmethod`` object is not callable: ``__class_getitem__`` (and ``__torch_function__``, which torch's subclasses
declare as a classmethod) were never walked, so the class-level state they change grew with each replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader


class Typed:
    """A generic container that records each type it is specialised for (a cache of specialisations)."""

    specialised: ClassVar[list[str]] = []

    def __class_getitem__(cls, item: type) -> type:
        Typed.specialised.append(item.__name__)
        return cls


class Specialising(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        Typed[torch.Tensor]  # runs ``__class_getitem__``
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_class_getitem_state_is_put_back(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Typed.specialised.clear()
        module = Specialising(cnn_net())
        return Case(module, loader(dataset_for("cnn"), batch_size=8), observe=lambda: list(Typed.specialised))

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
