"""A module that holds its own ``torch.Generator`` (issue 25, low): its step is replayed, the generator untouched.

0.11.0 never replayed such a step, and the reason it gave was an internal error ("SystemError: <method
'__setstate__' of 'torch._C.Generator' objects> returned a result with an exception set": a generator does not
deep-copy under the fake copy mode). The replay's copy of the module now holds a copy of each generator, in the same
state, so what the replay draws leaves the user's generators exactly where training left them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader


class NoiseSource:
    """A user's object holding a generator of its own."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)


class NoisyClassifier(Classifier):
    """Multiplies the logits by noise drawn from generators it holds (dropout-like, reproducible)."""

    def __init__(self) -> None:
        super().__init__(cnn_net())
        self.gen = torch.Generator().manual_seed(0)
        self.noise = NoiseSource(1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = self.network(inputs)
        outputs = outputs * (1 + 0.1 * torch.rand(outputs.shape, generator=self.gen))
        return outputs + 0.01 * torch.randn(outputs.shape, generator=self.noise.generator)


def build() -> Case:
    module = NoisyClassifier()

    def observe() -> Any:
        return (module.gen.get_state(), module.noise.generator.get_state())

    return Case(module, loader(dataset_for("cnn"), batch_size=8), observe=observe)


@pytest.mark.parametrize("path", PATHS)
def test_a_module_holding_a_generator_is_replayed_and_the_generator_is_untouched(tmp_path: Path, path: str) -> None:
    monitor = assert_untouched(build, tmp_path, path)
    report = monitor.report
    assert report is not None
    simulation = report.simulation
    assert simulation is not None
    assert simulation.skipped is None
    assert simulation.baseline is not None
