"""A ``torch.jit.trace`` submodule that updates a buffer in forward: training with the monitor runs as without it.

Under any dispatch mode (the CPU's live count is one) such a traced graph raises in torch itself: "aten::equal()
Expected a value of type 'Tensor' for argument 'self' but instead found type 'int'". The live count stands aside for
a model holding a traced module (its peaks are the counted parts, and the report says so); before, ``trainer.fit``
raised on the first sampled step (an attacker's case, this round).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, dataset_for, loader
from torch import nn

from lightning_vram.session.sampling import LIVE_PEAK


class Counting(nn.Module):
    """A Linear that counts its calls in a buffer and scales its output by them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 10)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * (1 + self.calls.float() * 0.01)


def build() -> Case:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 deprecates torch.jit.trace, and warns of the traced constant
        traced = torch.jit.trace(Counting(), torch.randn(2, 16), check_trace=False)
    network = nn.Sequential(nn.Linear(32, 16), traced, nn.Linear(10, 10))
    module = Classifier(network)
    return Case(module, loader(dataset_for("linear"), batch_size=8), observe=lambda: {"calls": traced.calls.clone()})


@pytest.mark.parametrize("path", PATHS)
def test_a_traced_submodule_updating_a_buffer_trains_as_without_the_monitor(tmp_path: Path, path: str) -> None:
    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=1, attribution_every_n_steps=1)
    report = monitor.report
    assert report is not None
    if path == "cpu":
        notes = {note.what: note.reason for note in report.not_measured}
        assert notes[LIVE_PEAK].startswith("network.1 is a torch.jit.trace module, whose graph can raise")
