"""What the report says when a step is not replayed, or replayed differently, in the user's terms (issue 25, low).

0.11.0 gave internal exception text or blamed the user's step: LBFGS ("TypeError: LBFGS.step() missing 1 required
positional argument: 'closure'"), anomaly detection ("the step reads a tensor's value (.item() ...)": the step does
not, anomaly detection does), Lightning's PyTorch profiler ("RuntimeError: Tried to deepcopy object
__torch__.torch.classes.profiler._RecordFunction ...") or a profiler around the step (replayed into the user's
trace), a sparse embedding ("NotImplementedError: Cannot access storage of SparseTensorImpl"). Each case trains with
and without the monitor, exactly, and reads the reason.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader
from torch import nn
from torch.utils.data import DataLoader

from lightning_vram import VramMonitor


def cnn_loader() -> DataLoader[Any]:
    return loader(dataset_for("cnn"), batch_size=8)


def simulation_of(monitor: VramMonitor) -> Any:
    report = monitor.report
    assert report is not None and report.simulation is not None
    return report.simulation


@pytest.mark.parametrize("path", PATHS)
def test_lbfgs_says_the_replay_cannot_follow_its_closure(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        return Case(Classifier(cnn_net(), partial(torch.optim.LBFGS, lr=0.1, max_iter=2)), cnn_loader())

    simulation = simulation_of(assert_untouched(build, tmp_path, path))
    assert simulation.skipped == (
        "LBFGS re-evaluates the loss through its closure up to max_iter=2 times within each optimizer step, and the"
        " replay runs one forward, backward and update per step: it cannot follow the optimizer's own loop, so the"
        " step is not replayed"
    )


@pytest.mark.parametrize("path", PATHS)
def test_anomaly_detection_is_off_in_the_replay_and_said_so(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        return Case(Classifier(cnn_net()), cnn_loader(), trainer_options={"detect_anomaly": True})

    simulation = simulation_of(assert_untouched(build, tmp_path, path))
    assert simulation.skipped is None
    assert simulation.baseline is not None
    assert (
        "autograd's anomaly detection (torch.autograd.detect_anomaly, Trainer(detect_anomaly=True)) was on: the replay"
        " ran without it, since it checks every backward result for NaN and fake tensors have no values; it keeps no"
        " tensors, so the memory counted is the same"
    ) in simulation.baseline.notes
    assert not torch.is_anomaly_enabled()  # Lightning turned it off after fit, and the replay left it as it found it


PROFILER_SKIP = (
    "the PyTorch profiler is recording (torch.profiler.profile around the step, or Lightning's"
    ' profiler="pytorch"): a replay\'s operations would show up in its trace as if training ran them, so the step'
    " is not replayed while it records"
)


class ProfilesTraining(pl.Callback):
    """Records every op of training in a ``torch.profiler.profile`` of the user's (listed before the monitor)."""

    def __init__(self) -> None:
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.profile.__enter__()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.profile.__exit__(None, None, None)


@pytest.mark.parametrize("path", PATHS)
def test_a_profiler_around_the_step_keeps_the_replay_out_of_its_trace(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        return Case(Classifier(cnn_net()), cnn_loader(), before_monitor=[ProfilesTraining()])

    assert simulation_of(assert_untouched(build, tmp_path, path)).skipped == PROFILER_SKIP


@pytest.mark.parametrize("path", PATHS)
def test_lightnings_pytorch_profiler_says_why_there_is_no_replay(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        return Case(Classifier(cnn_net()), cnn_loader(), trainer_options={"profiler": "pytorch"})

    assert simulation_of(assert_untouched(build, tmp_path, path)).skipped == PROFILER_SKIP


def sparse_embedding_net() -> nn.Module:
    """Embedding(50, 16, sparse=True) over 7 tokens, flattened, + Linear(7 * 16, 10)."""
    return nn.Sequential(nn.Embedding(50, 16, sparse=True), nn.Flatten(), nn.Linear(7 * 16, 10))


@pytest.mark.parametrize("path", PATHS)
def test_a_sparse_embedding_says_why_there_is_no_replay(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        return Case(Classifier(sparse_embedding_net()), loader(dataset_for("lstm"), batch_size=8))

    assert simulation_of(assert_untouched(build, tmp_path, path)).skipped == (
        "network.0 is an embedding with sparse=True: its gradient is a sparse tensor, which the replay's fake tensors"
        " cannot stand in for, so the step is not replayed"
    )
