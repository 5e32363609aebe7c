"""A metaclass's state: its ``__call__`` runs each time the step makes an instance of a class it made.

The walk took a user class's bases but never its metaclass, so a registry the metaclass keeps (every record made)
grew with each replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader


class Registry(type):
    """Keeps the name of every instance made of its classes."""

    made: ClassVar[list[str]] = []

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        Registry.made.append(cls.__name__)
        return super().__call__(*args, **kwargs)


class Record(metaclass=Registry):
    def __init__(self, step: int) -> None:
        self.step = step


class Recording(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        Record(batch_idx)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_a_metaclass_registry_the_step_adds_to(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Registry.made.clear()
        return Case(Recording(cnn_net()), loader(dataset_for("cnn"), batch_size=8), observe=lambda: list(Registry.made))

    assert_untouched(build, tmp_path, path)
