"""A buffer the step fills with a tensor computed from the weights (not a leaf): the monitor warns nothing about it.

torch warns on reading ``.grad`` of a tensor that is not a leaf ("The .grad attribute of a Tensor that is not a
leaf Tensor is being accessed"); the monitor's walk of the module's own objects (``inside_ids``: parameters,
buffers and their gradients) read every buffer's, at the sampled step and each replay, so a run with such a buffer
warned with the monitor and not without it (the suite's warnings are errors, so the replay was skipped instead).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import dataset_for, loader
from torch import nn


class KeepsAComputedBuffer(nn.Module):
    """A linear layer that keeps its last output's column mean in a buffer, still attached to the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 10)
        self.register_buffer("last_mean", torch.zeros(10), persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = self.linear(inputs)
        self.last_mean = outputs.mean(dim=0)  # not a leaf: it requires grad through the weights
        return outputs  # type: ignore[no-any-return]


def build_case() -> Case:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = KeepsAComputedBuffer()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.cross_entropy(self.net(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Case(Module(), loader(dataset_for("linear")))


@pytest.mark.parametrize("path", PATHS)
def test_a_non_leaf_buffer_brings_no_warning_and_the_step_is_replayed(tmp_path: Path, path: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = assert_untouched(build_case, tmp_path, path, attribution_start_step=1, attribution_every_n_steps=1)
    messages = [str(entry.message) for entry in caught if "not a leaf" in str(entry.message)]
    assert messages == []
    assert monitor.report is not None and monitor.report.simulation is not None
    assert monitor.report.simulation.skipped is None
