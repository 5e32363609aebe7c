"""Gradient accumulation and manual optimization, now replayed (issue 26, item 3), train exactly as without the monitor.

0.11.0 did not replay either (the report said so): nothing of the replay could touch them. Now the replay runs the
user's ``training_step`` two micro-batches at a time under accumulation, and under manual optimization calls
``self.optimizers()``, ``self.manual_backward``, each optimizer's ``step`` and ``zero_grad`` and
``toggle_optimizer`` as the user's code does, on its own copies. Each case trains with and without the monitor
(the CPU path, and the scripted CUDA path with its preflight), compares losses, weights, every optimizer's state,
the random generators and every hook's call count exactly, and checks that the step was replayed and matched.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader
from test_replay_manual import ToggledGan
from test_setups import gan_data

HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_optimizer_step",
    "optimizer_step",
    "on_train_batch_end",
)


class CountedClassifier(Classifier):
    """The classifier with every optimization hook counted on the instance."""

    def __init__(self) -> None:
        super().__init__(cnn_net(), OPTIMIZERS["adam"])
        self.calls: Counter[str] = Counter()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls["training_step"] += 1
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls["on_train_batch_start"] += 1

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.calls["on_before_backward"] += 1

    def on_after_backward(self) -> None:
        self.calls["on_after_backward"] += 1

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls["on_before_zero_grad"] += 1

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self.calls["optimizer_zero_grad"] += 1
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls["on_before_optimizer_step"] += 1

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls["on_train_batch_end"] += 1


class CountedGan(ToggledGan):
    """The toggled GAN with its manual calls counted on the instance."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.calls["training_step"] += 1
        super().training_step(batch, batch_idx)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.calls["manual_backward"] += 1
        super().manual_backward(loss, *args, **kwargs)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls["on_before_optimizer_step"] += 1

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls["on_train_batch_end"] += 1


def observed(module: Any) -> Any:
    """What the user would read back: every hook's count, every optimizer's state, the parameters' gradients."""
    optimizers = module.trainer.optimizers
    grads = [parameter.grad for parameter in module.parameters()]
    requires_grad = [parameter.requires_grad for parameter in module.parameters()]
    return dict(module.calls), [optimizer.state_dict() for optimizer in optimizers], grads, requires_grad


def replayed_and_matched(monitor: Any) -> None:
    report = monitor.report
    assert report is not None and report.simulation is not None
    simulation = report.simulation
    assert simulation.skipped is None, simulation.skipped
    assert simulation.match is not None and simulation.match.matches


@pytest.mark.parametrize("path", PATHS)
def test_gradient_accumulation_trains_exactly_as_without_the_monitor(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        module = CountedClassifier()
        return Case(
            module,
            loader(dataset_for("cnn"), batch_size=8),
            observe=lambda: observed(module),
            trainer_options={"accumulate_grad_batches": 4},
        )

    monitor = assert_untouched(build, tmp_path, path, steps=3, attribution_start_step=5)  # 12 micro-batches
    replayed_and_matched(monitor)


@pytest.mark.parametrize("path", PATHS)
def test_manual_optimization_with_two_optimizers_trains_exactly_as_without_the_monitor(
    tmp_path: Path, path: str
) -> None:
    def build() -> Case:
        module = CountedGan()
        return Case(module, gan_data(), observe=lambda: observed(module))

    monitor = assert_untouched(build, tmp_path, path, steps=8, attribution_start_step=2)  # 4 batches, 2 steps each
    replayed_and_matched(monitor)
