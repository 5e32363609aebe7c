"""A step that writes files through library calls, which the walk of its code does not see.

Found by the attack of 2026-11-27 (eighth session): the walk refuses a step whose own code names ``open``, but
``Path.open("a")``, ``Path.write_text``, ``np.savetxt``, a helper's ``io.open`` and ``os.remove`` ran again in each
replay (a step appending a line per step left 7 lines with the monitor for 6 without). The replay now refuses them as
they happen (``prediction/containment/audit.py``, an audit hook), before the file is opened, and says so.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, linear_net, loader
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import predict

FOLDER: list[Path] = []
"""This run's folder of the user's files (set by each case's build)."""


def small_loader() -> Any:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    return loader(data, batch_size=8)


def loss(module: Classifier, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs), targets)


class AppendsThroughPath(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with (FOLDER[0] / "steps.txt").open("a") as log:
            log.write(f"{batch_idx}\n")
        return loss(self, batch)


class RewritesText(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        path = FOLDER[0] / "steps.txt"
        path.write_text(path.read_text() + f"{batch_idx}\n")
        return loss(self, batch)


class SavesAnArray(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        path = FOLDER[0] / "steps.txt"
        np.savetxt(path, np.append(np.loadtxt(path, ndmin=1), batch_idx))
        return loss(self, batch)


def write_history(path: Path, entry: int) -> None:
    """A helper the step calls: it reads the history and writes it back longer, through ``io.open``."""
    history = json.loads(path.read_text())
    with io.open(path, "w") as file:  # noqa: UP020 -- io.open: the name the walk does not know as opening files
        json.dump([*history, entry], file)


class DumpsJsonThroughAHelper(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        write_history(FOLDER[0] / "steps.txt", batch_idx)
        return loss(self, batch)


class RemovesAScratchFile(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        os.remove(min(FOLDER[0].glob("scratch-*")))
        return loss(self, batch)


class CatchesTheRefusal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        try:
            with (FOLDER[0] / "steps.txt").open("a") as log:
                log.write(f"{batch_idx}\n")
        except Exception:  # noqa: BLE001 -- the user's own: a failed log line must not stop training
            pass
        return loss(self, batch)


RETRY_SECONDS = 30.0
"""How long the user's retry loop below tries before it gives up (on the unfixed code, each replay waited that long)."""


def append_retrying(path: Path, line: str) -> None:
    """A helper the step calls: it appends, retrying while the file is locked (a ``PermissionError``)."""
    give_up = time.monotonic() + RETRY_SECONDS
    while time.monotonic() < give_up:
        try:
            with path.open("a") as log:
                log.write(line)
            return
        except PermissionError:
            time.sleep(0.01)


class RetriesTheRefusal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        append_retrying(FOLDER[0] / "steps.txt", f"{batch_idx}\n")
        return loss(self, batch)


def start_files(folder: Path, log: str) -> None:
    """The user's files before training: the log (``log`` in it) and ten scratch files."""
    (folder / "steps.txt").write_text(log)
    for index in range(10):
        (folder / f"scratch-{index}").write_text("")


def files(folder: Path) -> dict[str, str]:
    """Every file of the folder and its contents (what the user would look at)."""
    return {path.name: path.read_text() for path in sorted(folder.iterdir())}


def build_for(kind: type[Classifier], root: Path, log: str) -> Callable[[], Case]:
    def build() -> Case:
        folder = root / f"files-{len(list(root.glob('files-*')))}"
        folder.mkdir()
        start_files(folder, log)
        FOLDER[:] = [folder]
        return Case(kind(linear_net()), small_loader(), observe=lambda: files(folder))

    return build


CASES = {  # the step, what the log holds before training, what the reason names
    "Path.open('a')": (AppendsThroughPath, "", "writes files (open(", "steps.txt', 'a'))"),
    "Path.write_text": (RewritesText, "", "writes files (open(", "steps.txt', 'w'))"),
    "np.savetxt": (SavesAnArray, "-1\n", "writes files (open(", "steps.txt', 'w'))"),
    "json.dump into a helper's io.open": (DumpsJsonThroughAHelper, "[]", "writes files (open(", "steps.txt', 'w'))"),
    "os.remove": (RemovesAScratchFile, "", "removes files (os.remove(", "scratch-"),
    "a caught refusal": (CatchesTheRefusal, "", "writes files (open(", "steps.txt', 'a'))"),
    "a refusal retried": (RetriesTheRefusal, "", "writes files (open(", "steps.txt', 'a'))"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_step_writing_files_through_a_library_writes_them_once(tmp_path: Path, path: str, case: str) -> None:
    kind, log, does, call = CASES[case]
    build = build_for(kind, tmp_path, log)
    started = time.monotonic()
    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    # a step retrying a refused write (a lock file) stops at its second try, past its ``except PermissionError``:
    # it retried for RETRY_SECONDS in each replay before (an unbounded loop never ended, training with it)
    assert time.monotonic() - started < RETRY_SECONDS, "a replay waited for the user's retry loop"
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None, simulation
    assert does in simulation.skipped and call in simulation.skipped, simulation.skipped
    assert "a replay would" in simulation.skipped, simulation.skipped


class ReadsAFile(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with (FOLDER[0] / "scale.txt").open("r") as file:
            scale = float(file.read())
        return loss(self, batch) * scale


@pytest.mark.parametrize("path", PATHS)
def test_a_step_only_reading_a_file_is_replayed(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        folder = tmp_path / f"files-{len(list(tmp_path.glob('files-*')))}"
        folder.mkdir()
        (folder / "scale.txt").write_text("0.5")
        FOLDER[:] = [folder]
        return Case(ReadsAFile(linear_net()), small_loader(), observe=lambda: files(folder))

    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
    assert simulation.skipped is None


def test_predict_refuses_a_step_writing_files_and_writes_nothing(tmp_path: Path) -> None:
    FOLDER[:] = [tmp_path]
    module = AppendsThroughPath(linear_net())
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    prediction = predict(module, batch, device_type="cpu", fit_table=False)
    assert prediction.skipped is not None and "writes files (open(" in prediction.skipped, prediction.skipped
    assert str(tmp_path / "steps.txt") in prediction.skipped
    assert not (tmp_path / "steps.txt").exists(), "the refused replay created the file"


class WritesToADescriptor(Classifier):
    """Writes each step's line to a descriptor opened before training (no audit event announces ``os.write``)."""

    def __init__(self, descriptor: int) -> None:
        super().__init__(linear_net())
        self.descriptor = descriptor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        os.write(self.descriptor, f"{batch_idx}\n".encode())
        return loss(self, batch)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_writing_to_a_descriptor_opened_before_writes_once(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        folder = tmp_path / f"files-{len(list(tmp_path.glob('files-*')))}"
        folder.mkdir()
        descriptor = os.open(folder / "steps.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

        def observe() -> dict[str, str]:
            os.close(descriptor)
            return files(folder)

        return Case(WritesToADescriptor(descriptor), small_loader(), observe=observe)

    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None, simulation
    assert "writes to a file descriptor (os.write" in simulation.skipped, simulation.skipped
