"""A step whose code reaches more objects than one walk visits is not replayed: what it could change is unknown.

A module of its own: the walk reads a module's whole namespace where its code computes names (``globals()``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from harness import Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader

from lightning_vram.prediction.containment.reach import WALK_LIMIT


def cnn_loader() -> Any:
    return loader(dataset_for("cnn"), batch_size=8)


MANY = [[index] for index in range(30_000)]  # more objects than one walk visits


class ReadsAHugeStructure(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        MANY[batch_idx].append(batch_idx)
        return super().training_step(batch, batch_idx)


def test_a_step_reaching_more_than_one_walk_visits_is_not_replayed(tmp_path: Path) -> None:
    def build() -> Case:
        for index in range(8):
            del MANY[index][1:]
        return Case(ReadsAHugeStructure(cnn_net()), cnn_loader(), observe=lambda: [list(item) for item in MANY[:8]])

    monitor = assert_untouched(build, tmp_path, "cpu")
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None
    assert f"more than {WALK_LIMIT} objects" in simulation.skipped
