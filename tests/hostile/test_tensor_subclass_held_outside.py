"""A tensor subclass held outside the module: the monitor's own reads and copies of it must not run its code.

The replay saves each tensor the step reaches outside the module (its version counter, a copy of its values) and
sizes them before deciding to run. Each of those calls went through the subclass's ``__torch_function__``, the
user's code: a subclass counting its calls counted 25 (CPU path) and 42 (CUDA path) calls that training without the
monitor never made.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader


class Counted(torch.Tensor):
    """Counts the torch functions called on it."""

    calls: ClassVar[int] = 0

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        Counted.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


SCALE = torch.ones(1).as_subclass(Counted)


class Scaled(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * SCALE.as_subclass(torch.Tensor)  # no torch function runs


@pytest.mark.parametrize("path", PATHS)
def test_the_monitor_runs_no_torch_function_of_a_subclass_held_outside(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Counted.calls = 0
        return Case(Scaled(cnn_net()), loader(dataset_for("cnn"), batch_size=8), observe=lambda: Counted.calls)

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
