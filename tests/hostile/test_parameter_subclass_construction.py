"""A ``Parameter`` subclass of the user's whose construction counts: the replay's copies of it count nowhere.

The replay's copy of the module constructs each parameter of a subclass again (``Parameter.__deepcopy__`` calls
``type(self)(data, requires_grad)``); the walk reached the submodules' classes, never their parameters' classes, so
what the subclass's ``__new__`` changed was not saved: a class counter numbering the parameters ended at 5 for 1, and
the user's registry of them held 5 entries (the CPU path's replays; 9 on the CUDA path, preflight's included; found
attacking the copy's parameters, twelfth session). Its class is now a root of the walk, constructed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import OPTIMIZERS, Classifier, dataset_for, loader
from torch import nn

REGISTRY: list[str] = []
"""Every numbered parameter made, as the user's tooling lists them."""


class NumberedParameter(nn.Parameter):
    """A parameter numbered as it is made, from a class counter, and listed in the user's registry."""

    made = 0

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        NumberedParameter.made += 1
        REGISTRY.append(f"parameter {NumberedParameter.made}")
        return super().__new__(cls, data, requires_grad)


class Numbered(Classifier):
    def __init__(self) -> None:
        network = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
        super().__init__(network, OPTIMIZERS["adam"])
        network[2].weight = NumberedParameter(network[2].weight.detach().clone())


@pytest.mark.parametrize("path", PATHS)
def test_a_parameter_subclass_counts_only_the_users_parameters(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        NumberedParameter.made = 0
        REGISTRY.clear()
        module = Numbered()
        return Case(
            module,
            loader(dataset_for("linear"), batch_size=8),
            observe=lambda: (NumberedParameter.made, list(REGISTRY)),
        )

    monitor = assert_untouched(build, tmp_path, path, steps=3)
    assert monitor.report is not None and monitor.report.simulation is not None
    assert monitor.report.simulation.skipped is None, monitor.report.simulation.skipped
