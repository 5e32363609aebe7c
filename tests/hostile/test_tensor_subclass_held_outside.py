"""A tensor subclass held outside the module: the monitor's own reads and copies of it must not run its code.

The replay saves each tensor the step reaches outside the module (its version counter, a copy of its values) and
sizes them before deciding to run. Each of those calls went through the subclass's ``__torch_function__``, the
user's code: a subclass counting its calls counted 25 (CPU path) and 42 (CUDA path) calls that training without the
monitor never made. A subclass's class was not walked either (its ``__torch_function__``, a classmethod, was
skipped as a non-callable dunder), so the calls a replay made were not put back. Where the step itself multiplies by
the subclass, the sampled step's own measurement ran it too (4 calls without the monitor, 208 with it on the CPU
path, 5 on the CUDA path): the CPU's live count calls each op again from Python in its ``__torch_dispatch__`` and
reads the outputs' storages, and the saved-tensor hooks read theirs; each now runs with ``__torch_function__`` of
subclasses off.
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


class MultipliesBySubclass(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx) * SCALE  # Counted.__torch_function__ runs, in training too
        return loss.as_subclass(torch.Tensor)


@pytest.mark.parametrize("path", PATHS)
def test_a_subclass_torch_function_the_step_runs_runs_as_often_with_the_monitor(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Counted.calls = 0
        module = MultipliesBySubclass(cnn_net())
        return Case(module, loader(dataset_for("cnn"), batch_size=8), observe=lambda: Counted.calls)

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None, simulation
