"""A LightningModule whose ``__init__`` parses ``sys.argv`` or ``exec``s its configuration, as scripts do.

The walk took every dunder of the model's classes, ``__init__`` among them, though the step never constructs the
model: a script holding its model in a global (``model = Net()``) had every replay refused, with the reason "the
step's code reaches the trained model itself (ReadsArgv.__init__: global m)" (reading ``sys`` or running ``exec``
puts every global of the module in reach). Now the replay runs, and training is bit-identical with and without the
monitor. A step that does construct a class whose ``__init__`` acts outside the replay is still refused, and the reason
says what that code does.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, dataset_for, loader, transformer_net
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.records import SavingBasis

MODEL: Any = None
"""The model, held in a global as a script holds it."""
OUTPUT: Path | None = None


class ReadsArgv(Classifier):
    """Parses its options from ``sys.argv`` as it is built."""

    def __init__(self, network: nn.Module) -> None:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--vram-test-lr", type=float, default=0.01)
        arguments, _ = parser.parse_known_args(sys.argv[1:])
        super().__init__(network, partial(torch.optim.SGD, lr=arguments.vram_test_lr))


class ExecsConfig(Classifier):
    """Runs its configuration (a Python snippet) as it is built."""

    def __init__(self, network: nn.Module, config: str = "lr = 0.01") -> None:
        namespace: dict[str, Any] = {}
        exec(config, namespace)
        super().__init__(network, partial(torch.optim.SGD, lr=namespace["lr"]))


def _small() -> Any:
    return loader(dataset_for("transformer", samples=32), batch_size=8)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", [ReadsArgv, ExecsConfig], ids=lambda kind: kind.__name__)
def test_a_model_whose_init_reads_argv_or_runs_exec_is_replayed_and_training_bit_identical(
    tmp_path: Path, path: str, kind: type[Classifier]
) -> None:
    def build() -> Case:
        global MODEL
        MODEL = kind(transformer_net())  # type: ignore[call-arg]
        return Case(MODEL, _small())

    try:
        monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    finally:
        globals()["MODEL"] = None
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert simulation.baseline is not None
    report = monitor.report
    assert report is not None
    if path == "cpu":  # the scripted probe's figures (the CUDA path) leave nothing to advise on
        checkpointing = next((advice for advice in report.advice if advice.id == "activation-checkpointing"), None)
        assert checkpointing is not None, [advice.id for advice in report.advice]
        assert checkpointing.saving_basis is SavingBasis.SIMULATED, checkpointing.evidence


class Journal:
    """Appends a line to the run's journal as it is built."""

    def __init__(self, step: int) -> None:
        assert OUTPUT is not None
        with open(OUTPUT / "journal.txt", "a") as journal:
            journal.write(f"{step}\n")


class Options:
    """Parses the step's options from ``sys.argv`` as it is built."""

    def __init__(self) -> None:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--vram-test-lr", type=float, default=0.01)
        self.learning_rate = float(parser.parse_known_args(sys.argv[1:])[0].vram_test_lr)


class JournalsInTheStep(ReadsArgv):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        Journal(batch_idx)
        return super().training_step(batch, batch_idx)


class ReadsOptionsInTheStep(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        scale = Options().learning_rate / 0.01
        return super().training_step(batch, batch_idx) * scale


@pytest.mark.parametrize("path", PATHS)
def test_a_step_constructing_a_class_whose_init_writes_a_file_is_refused_and_says_so(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global MODEL, OUTPUT
        OUTPUT = tmp_path / f"files-{len(list(tmp_path.glob('files-*')))}"
        OUTPUT.mkdir()
        written = OUTPUT
        MODEL = JournalsInTheStep(transformer_net())
        return Case(MODEL, _small(), observe=lambda: (written / "journal.txt").read_text())

    try:
        monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    finally:
        globals()["MODEL"] = None
    assert (tmp_path / "files-1" / "journal.txt").read_text() == "0\n1\n2\n3\n"  # training's four steps, no replay's
    skipped = _skipped(monitor)
    assert "Journal.__init__ opens files (what it writes would be written again)" in skipped, skipped
    assert "a replay would do it again" in skipped


@pytest.mark.parametrize("path", PATHS)
def test_a_step_constructing_a_class_whose_init_reads_argv_is_refused_for_what_it_does(
    tmp_path: Path, path: str
) -> None:
    def build() -> Case:
        global MODEL
        MODEL = ReadsOptionsInTheStep(transformer_net())
        return Case(MODEL, _small())

    try:
        monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    finally:
        globals()["MODEL"] = None
    skipped = _skipped(monitor)
    assert skipped.startswith("the step's code (Options.__init__ reads sys.argv) reaches every global of its module")
    assert "global MODEL" in skipped, skipped


def _skipped(monitor: VramMonitor) -> str:
    """Why the monitor's replays did not run; every advice it gave is modelled, none simulated."""
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None, simulation
    report = monitor.report
    assert report is not None
    assert all(advice.saving_basis is not SavingBasis.SIMULATED for advice in report.advice)
    return simulation.skipped
