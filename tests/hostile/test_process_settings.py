"""Process-wide settings the step changes: a replay puts them back (attack 18, A and B).

Some cases fail on only one path without the fix: a toggle flipped by an even number of replays (the CUDA path's
preflight and first sampled step) reads the same, and a set-up done at step 0 is done before the CPU path's replay.

torch's deterministic-algorithms flag, cuDNN's benchmark flag, Python's recursion limit, the ``decimal`` context's
precision and torch's default device: the step changes each, and its loss follows what it finds, so a replay that
leaves one changed trains a different model (or, for the default device, makes the user's next
``torch.set_default_device`` find two device contexts on the mode stack and raise).
"""

from __future__ import annotations

import decimal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, dataset_for, linear_net, loader
from torch import nn
from torch.overrides import _get_current_function_mode_stack


@pytest.fixture(autouse=True)
def settings_put_back() -> Iterator[None]:
    """Each test starts from, and leaves, this process's settings as they were."""
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    limit = sys.getrecursionlimit()
    context = decimal.getcontext().copy()
    yield
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    torch.backends.cudnn.benchmark = benchmark
    sys.setrecursionlimit(limit)
    decimal.setcontext(context)
    torch.set_default_device(None)


def scaled_loss(module: Classifier, batch: Any, scale: float) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs) * scale, targets)


class SetsUpOnce(Classifier):
    """Turns deterministic algorithms on at its first step; the loss differs until it has."""

    set_up_at: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(True, warn_only=True)
            self.set_up_at = batch_idx
        return scaled_loss(self, batch, 1.0 if self.set_up_at is not None else 2.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_one_time_set_up_keyed_on_the_deterministic_flag_runs_at_the_users_step(tmp_path: Path, path: str) -> None:
    module: list[SetsUpOnce] = []

    def build() -> Case:
        torch.use_deterministic_algorithms(False)
        module[:] = [SetsUpOnce(linear_net())]

        def observe() -> Any:
            flags = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
            return flags, module[0].set_up_at

        return Case(module[0], loader(dataset_for("linear")), observe=observe)

    assert_untouched(build, tmp_path, path)


class TogglesBenchmark(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
        return scaled_loss(self, batch, 1.5 if torch.backends.cudnn.benchmark else 1.0)


class TurnsOnBenchmarkOnce(Classifier):
    """Turns cuDNN's benchmark on at its first step; the loss differs until it has."""

    set_up_at: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not torch.backends.cudnn.benchmark:
            torch.backends.cudnn.benchmark = True
            self.set_up_at = batch_idx
        return scaled_loss(self, batch, 1.0 if self.set_up_at is not None else 2.0)


class RaisesTheRecursionLimit(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        sys.setrecursionlimit(sys.getrecursionlimit() + 1)
        return scaled_loss(self, batch, 1.0 + 0.1 * (sys.getrecursionlimit() - 1000))


class RaisesTheDecimalPrecision(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        decimal.getcontext().prec += 1
        return scaled_loss(self, batch, 1.0 + 0.1 * (decimal.getcontext().prec - 28))


def benchmark_case() -> Case:
    torch.backends.cudnn.benchmark = False
    return Case(
        TogglesBenchmark(linear_net()), loader(dataset_for("linear")), observe=lambda: torch.backends.cudnn.benchmark
    )


def benchmark_once_case() -> Case:
    torch.backends.cudnn.benchmark = False
    module = TurnsOnBenchmarkOnce(linear_net())
    return Case(
        module, loader(dataset_for("linear")), observe=lambda: (torch.backends.cudnn.benchmark, module.set_up_at)
    )


def recursion_case() -> Case:
    sys.setrecursionlimit(1000)
    return Case(RaisesTheRecursionLimit(linear_net()), loader(dataset_for("linear")), observe=sys.getrecursionlimit)


def decimal_case() -> Case:
    decimal.getcontext().prec = 28
    return Case(
        RaisesTheDecimalPrecision(linear_net()),
        loader(dataset_for("linear")),
        observe=lambda: decimal.getcontext().prec,
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "build",
    [benchmark_case, benchmark_once_case, recursion_case, decimal_case],
    ids=["benchmark-toggled", "benchmark-once", "recursion", "decimal"],
)
def test_a_setting_the_step_changes_is_put_back(tmp_path: Path, path: str, build: Any) -> None:
    assert_untouched(build, tmp_path, path)


class SetsTheDefaultDevice(Classifier):
    """Makes sure new tensors land on the CPU, at every step (a helper's habit)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        torch.set_default_device("cpu")
        return scaled_loss(self, batch, 1.0 + torch.ones(1).item())


@pytest.mark.parametrize("path", PATHS)
def test_the_default_device_set_in_the_step_is_put_back(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        torch.set_default_device(None)

        def observe() -> Any:
            modes = [type(mode).__name__ for mode in _get_current_function_mode_stack()]  # type: ignore[no-untyped-call]
            return modes, str(torch.get_default_device())

        return Case(SetsTheDefaultDevice(linear_net()), loader(dataset_for("linear")), observe=observe)

    assert_untouched(build, tmp_path, path)
