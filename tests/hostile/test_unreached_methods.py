"""A model whose methods outside the training step write files: replayed, and training untouched.

The walk used to take in every method of the model's classes, so an ``export`` calling ``torch.save`` that training
never calls refused every replay. Now that only what the step may call is walked, the replay runs beside those
methods: it must not call them, and the ones training runs for real (``on_train_epoch_end`` writing a log) must write
exactly what they write without the monitor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader

FOLDER: Path | None = None


class Exporting(Classifier):
    """A CNN classifier with an ``export`` the user calls after training, and an epoch-end log training writes."""

    def export(self, name: str) -> None:
        assert FOLDER is not None
        torch.save(self.state_dict(), FOLDER / name)

    def on_train_epoch_end(self) -> None:
        assert FOLDER is not None
        with open(FOLDER / "epochs.txt", "a") as log:
            log.write(f"{self.current_epoch} {self.network[0].weight.sum().item():.9e}\n")


@pytest.mark.parametrize("path", PATHS)
def test_methods_training_never_calls_leave_the_step_replayed_and_training_bit_identical(
    tmp_path: Path, path: str
) -> None:
    def build() -> Case:
        global FOLDER
        FOLDER = tmp_path / f"files-{len(list(tmp_path.glob('files-*')))}"
        FOLDER.mkdir()
        written = FOLDER

        def observe() -> Any:
            return sorted(file.name for file in written.iterdir()), (written / "epochs.txt").read_text()

        return Case(Exporting(cnn_net()), loader(dataset_for("cnn", samples=32), batch_size=8), observe=observe)

    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert simulation.baseline is not None
    assert sorted(file.name for file in (tmp_path / "files-1").iterdir()) == ["epochs.txt"]  # no export.pt
