"""A user's ``TorchFunctionMode`` (a call counter) spanning each step, or the whole of ``fit``, sees what it sees
without the monitor.

Found attacking the replayed accumulation and manual optimization: unlike a dispatch mode, a torch-function mode
stayed on the stack for everything the monitor did. A counter spanning each step saw the monitor's own tensor
calls on every step (``dim``, ``untyped_storage``, ``numel``, ``register_post_accumulate_grad_hook``: on the sampled
step 439 property reads where training made 31); one spanning ``fit`` on a small ResNet saw 74,228 calls where
training made 2,380 (the replays of the user's step, the CPU's host measurement). Each case trains with and without
the monitor and compares every step's counts (and losses, weights, optimizer state, RNG) exactly.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import ResNetStyle, images
from harness import PATHS, Case, assert_untouched
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader
from test_accumulation_and_manual import CountedGan, replayed_and_matched
from test_setups import gan_data
from torch.overrides import TorchFunctionMode

from lightning_vram.prediction.timing import host


class CallCounter(TorchFunctionMode):
    """The user's torch-function mode: every torch function and tensor method it sees, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class EachStep(pl.Callback):
    """Enters a call counter at each batch's start and leaves it at its end; keeps each step's counts."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._counter = CallCounter()

    def on_train_batch_start(self, *_args: Any) -> None:
        self._counter = CallCounter()
        self._counter.__enter__()

    def on_train_batch_end(self, *_args: Any) -> None:
        self._counter.__exit__(None, None, None)
        self.steps.append(dict(self._counter.calls))


class WholeFit(pl.Callback):
    """Enters one call counter at setup and leaves it at teardown: the whole of ``fit``, the monitor's end included."""

    def __init__(self) -> None:
        self.counter = CallCounter()

    def setup(self, *_args: Any, **_kwargs: Any) -> None:
        self.counter.__enter__()

    def teardown(self, *_args: Any, **_kwargs: Any) -> None:
        self.counter.__exit__(None, None, None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["accumulating", "manual"])
def test_a_function_mode_spanning_each_step_counts_as_without_the_monitor(tmp_path: Path, path: str, kind: str) -> None:
    def build() -> Case:
        counter = EachStep()
        if kind == "manual":
            return Case(CountedGan(), gan_data(), observe=lambda: counter.steps, before_monitor=[counter])
        module = Classifier(cnn_net(), OPTIMIZERS["adam"])
        options = {"accumulate_grad_batches": 4}
        return Case(module, loader(dataset_for("cnn"), 8), lambda: counter.steps, options, before_monitor=[counter])

    steps, start = (8, 2) if kind == "manual" else (3, 5)
    monitor = assert_untouched(build, tmp_path, path, steps=steps, attribution_start_step=start)
    replayed_and_matched(monitor)


def test_a_function_mode_spanning_fit_sees_no_replay_and_no_host_measurement(tmp_path: Path) -> None:
    host.measure_host_peaks.cache_clear()  # measured once per process: by this run's monitor

    def build() -> Case:
        counter = WholeFit()
        torch.manual_seed(1)
        module = Classifier(ResNetStyle())
        return Case(module, loader(images(32 * 6), 32), lambda: dict(counter.counter.calls), before_monitor=[counter])

    monitor = assert_untouched(build, tmp_path, "cpu", steps=3, attribution_start_step=2)
    report = monitor.report
    assert report is not None and report.simulation is not None and report.simulation.skipped is None
    assert host.measure_host_peaks.cache_info().currsize == 1  # the CPU was measured inside the counter
    assert any(advice.predicted_step_seconds is not None for advice in report.advice)
