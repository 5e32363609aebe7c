"""A model class loaded without a ``sys.modules`` entry is the user's code, however it got into the process.

Found by the fourth hostile round (issue 25, H3): a class from ``importlib.util.spec_from_file_location`` and
``exec_module``, ``runpy.run_path`` or ``exec`` of source has a ``__module__`` that names no module in
``sys.modules``, and 0.11.0 took it for library code: its step was replayed with nothing saved or put back, and
the user's counter (and the weights it scales) ended past the steps trained.
"""

from __future__ import annotations

import importlib.util
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import PATHS, Case, assert_untouched
from models import dataset_for, loader

SOURCE = """
import lightning.pytorch as pl
import torch
from torch import nn

COUNTS = {"steps": 0}


class HandLoaded(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.network = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))

    def forward(self, inputs):
        return self.network(inputs)

    def training_step(self, batch, batch_idx):
        COUNTS["steps"] += 1
        inputs, targets = batch
        scale = 1.0 + 0.25 * COUNTS["steps"]  # the weights follow the counter
        return nn.functional.cross_entropy(self(inputs) * scale, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def by_spec(path: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("hand_loaded_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)  # never put in sys.modules
    spec.loader.exec_module(module)
    return vars(module)


def by_run_path(path: Path) -> dict[str, Any]:
    return runpy.run_path(str(path))


def by_exec(path: Path) -> dict[str, Any]:
    namespace: dict[str, Any] = {}  # no __name__: the class's __module__ is "builtins"
    exec(path.read_text(), namespace)  # its code's file is "<string>"
    return namespace


def by_exec_named(path: Path) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "generated_models"}
    exec(compile(path.read_text(), "<exec>", "exec"), namespace)
    return namespace


LOADERS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "spec_from_file_location": by_spec,
    "run_path": by_run_path,
    "exec": by_exec,
    "exec_named": by_exec_named,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("form", LOADERS)
def test_a_class_loaded_by_hand_is_contained(tmp_path: Path, path: str, form: str) -> None:
    source = tmp_path / "hand_loaded_model.py"
    source.write_text(SOURCE)

    def build() -> Case:
        namespace = LOADERS[form](source)
        counts = namespace["COUNTS"]  # the very dict the step's globals hold (run_path returns a copy of them)
        return Case(namespace["HandLoaded"](), loader(dataset_for("cnn"), batch_size=8), observe=lambda: dict(counts))

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
    assert any("put back" in note for note in simulation.baseline.notes), simulation.baseline.notes
