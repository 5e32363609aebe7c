"""Code that reads attributes by computed names, in a script whose global holds the trained model.

The advice's own `Checkpointed` wrapper reads the wrapped block's attributes with ``getattr(self.block, name)``. A
script that builds its model at module level (``model = Net()``) and wraps it as printed must still be replayed:
``getattr`` on the code's own objects reaches no module's globals. ``getattr`` on a module named in the code does, so
a step doing that with the model in a global is still refused, with the reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader
from torch import nn
from torch.utils.data import DataLoader

from lightning_vram.advice.checkpoint_code import CHECKPOINTED_CLASS, KEEPING_BUFFERS

exec(KEEPING_BUFFERS + CHECKPOINTED_CLASS)  # the wrapper exactly as the advice prints it, in this script's globals

MODEL: Any = None
"""The trained model, held by a global as a script's ``model = Net()`` holds it."""


def cnn_loader() -> DataLoader[Any]:
    return loader(dataset_for("cnn"), batch_size=8)


def wrapped_cnn() -> Classifier:
    network = cnn_net()
    network[0] = Checkpointed(network[0])  # type: ignore[name-defined]  # noqa: F821 -- defined by the exec above
    return Classifier(network)


@pytest.mark.parametrize("path", PATHS)
def test_the_printed_wrapper_is_replayed_in_a_script_whose_global_holds_the_model(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global MODEL
        MODEL = wrapped_cnn()
        return Case(MODEL, cnn_loader())

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert simulation.baseline is not None


class ReadsAModuleByName(Classifier):
    constant = "pi"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        scale = getattr(math, self.constant)  # a module's attribute by a computed name
        return nn.functional.cross_entropy(self(inputs) * (scale / math.pi), targets)


@pytest.mark.parametrize("path", PATHS)
def test_getattr_on_a_module_with_the_model_in_a_global_is_refused(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global MODEL
        MODEL = ReadsAModuleByName(cnn_net())
        return Case(MODEL, cnn_loader())

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None
    assert "global MODEL" in simulation.skipped
