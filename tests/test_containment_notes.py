"""A replay's note names where the state it put back was found: an attribute of the module is not "held outside
the module"."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from models import Classifier
from torch import nn

from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import ReplayedStep

pytestmark = pytest.mark.replay

OUTSIDE: list[int] = []


class Attribute(Classifier):
    """Appends each batch index to a list the module holds as an attribute."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 2))
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch_idx)
        return super().training_step(batch, batch_idx)


class ClassAttribute(Classifier):
    """Appends to a list its class holds."""

    seen: ClassVar[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch_idx)
        return super().training_step(batch, batch_idx)


class Global(Classifier):
    """Appends to a module-level list."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        OUTSIDE.append(batch_idx)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("build", "note"),
    [
        (Attribute, "the replayed code changed the model.seen (a list); put back as it was"),
        (
            lambda: ClassAttribute(nn.Linear(8, 2)),
            "the replayed code changed ClassAttribute.seen (a list); put back as it was",
        ),
        (
            lambda: Global(nn.Linear(8, 2)),
            "the replayed code changed Global.training_step: global OUTSIDE (a list); put back as it was",
        ),
    ],
)
def test_the_note_names_where_the_list_the_step_changed_is_held(build: Any, note: str) -> None:
    torch.manual_seed(0)
    module = build()
    with round_of_replays():
        step = Predictor(module, None, (torch.randn(4, 8), torch.randint(0, 2, (4,)))).baseline()
    assert isinstance(step, ReplayedStep)
    assert step.notes == (note,)
    assert getattr(module, "seen", OUTSIDE) == [] and OUTSIDE == []  # put back
