"""The user's error and a KeyboardInterrupt, at a sampled step and inside its replay, reach the user as without it.

Under automatic optimization the replay of a sampled step runs at the step's end (``on_train_batch_end``), calling
the user's ``training_step`` again on fake tensors. An error the user's real step raises at the sampled step must
come out of ``fit`` as the very object raised, with the same frames; an error the user's code raises only inside the
replay is the replay's to report (training goes on, exactly as without the monitor). A KeyboardInterrupt is
Lightning's graceful shutdown (``SystemExit(1)``) whichever code it interrupts: interrupted inside the replay, the
run must stop with the user's weights, generators and objects exactly as a run interrupted at that step's end without
the monitor, and leave nothing of the replay behind. The CUDA path replays first before step 0 (preflight): there the
interrupt is set against one arriving as step 0 starts.
"""

from __future__ import annotations

import random
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from harness import PATHS, equal, monitor_for
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader, trainer
from test_user_errors_in_replayed_steps import leftovers
from torch._subclasses.fake_tensor import FakeTensor


class UserError(Exception):
    """The user's own error."""


class Raising(Classifier):
    """Raises ``error`` from ``training_step``: on its real call ``at`` (0-based), or (``at=None``) replayed only."""

    def __init__(self, error: BaseException, at: int | None) -> None:
        super().__init__(cnn_net(), OPTIMIZERS["adam"])
        self.error, self.at = error, at
        self.calls: list[int] = []
        self.drawn: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        self.drawn.append(torch.rand(2))  # a draw of the global generator every call
        replayed = isinstance(inputs, FakeTensor)
        if self.at is None and replayed:  # the user's code failing only under the replay
            raise self.error
        self.calls.append(batch_idx)
        if len(self.calls) - 1 == self.at and not replayed:  # the replay's copy counts its own calls
            raise self.error
        return super().training_step(batch, batch_idx)


class Interrupted(pl.Callback):
    """Without the monitor: the interrupt arrives where the replay would run, at the end of sampled step ``at``
    (the CPU path), or (``at=None``) at the start of step 0 (the CUDA path: the preflight replay)."""

    def __init__(self, error: BaseException, at: int | None) -> None:
        self.error, self.at = error, at

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.at is None:
            raise self.error

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.at:
            raise self.error


@pytest.fixture(autouse=True)
def sigint_kept() -> Iterator[None]:
    """Lightning ignores SIGINT after a KeyboardInterrupt (for its shutdown): each test puts the handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def frames(error: BaseException) -> list[tuple[str, str, int]]:
    return [(frame.filename, frame.name, frame.lineno or 0) for frame in traceback.extract_tb(error.__traceback__)]


def outcome(
    root: Path, error: BaseException, at: int | None, monitor: Any, callbacks: list[pl.Callback]
) -> dict[str, Any]:
    """Train until ``error`` (or to the end); what came out and what the user reads back."""
    pl.seed_everything(0, verbose=False)
    module = Raising(error, at)
    run = trainer(root, [*callbacks, *([monitor] if monitor is not None else [])], max_steps=4)
    raised: BaseException | None = None
    try:
        run.fit(module, loader(dataset_for("cnn"), batch_size=8))
    except BaseException as caught:  # noqa: BLE001 -- what fit lets out is what the test compares
        raised = caught
    return {
        "raised": type(raised),
        "same": raised is error or (raised is not None and raised.__context__ is error),
        "message": str(raised),
        "frames": frames(raised) if raised is not None else None,
        "interrupted": run.interrupted,
        "steps": run.global_step,
        "calls": module.calls,
        "drawn": module.drawn,
        "weights": {name: tensor.clone() for name, tensor in module.state_dict().items()},
        "optimizer": run.optimizers[0].state_dict() if run.optimizers else None,
        "generators": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tobytes()),
        **leftovers(module),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", [UserError, KeyboardInterrupt])
def test_raised_by_the_users_sampled_step_reaches_them_untouched(tmp_path: Path, path: str, kind: type) -> None:
    bare = outcome(tmp_path / "bare", kind("the user's own"), 1, None, [])
    watched = outcome(tmp_path / "watched", kind("the user's own"), 1, monitor_for(path), [])
    assert bare["same"] and bare["raised"] is (UserError if kind is UserError else SystemExit)
    for key in bare:
        assert equal(bare[key], watched[key]), (key, bare[key], watched[key])


@pytest.mark.parametrize("path", PATHS)
def test_the_users_error_raised_in_the_replay_alone_leaves_training_as_without_the_monitor(
    tmp_path: Path, path: str
) -> None:
    bare = outcome(tmp_path / "bare", UserError("only replayed"), None, None, [])
    monitor = monitor_for(path)
    watched = outcome(tmp_path / "watched", UserError("only replayed"), None, monitor, [])
    assert bare["raised"] is type(None) and bare["steps"] == 4
    assert equal(bare, watched)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None and "only replayed" in simulation.skipped


@pytest.mark.parametrize("path", PATHS)
def test_a_keyboard_interrupt_inside_the_replay_stops_the_run_as_at_that_steps_end(tmp_path: Path, path: str) -> None:
    sampled = 1 if path == "cpu" else None
    bare = outcome(tmp_path / "bare", KeyboardInterrupt(), None, None, [Interrupted(KeyboardInterrupt(), sampled)])
    watched = outcome(tmp_path / "watched", KeyboardInterrupt(), None, monitor_for(path), [])
    assert bare["raised"] is SystemExit and bare["interrupted"] and bare["steps"] == (2 if path == "cpu" else 0)
    for key in ("raised", "message", "interrupted", "steps", "calls", "weights", "optimizer", "generators"):
        assert equal(bare[key], watched[key]), f"{key} differs"
    leftover = ("module_hooks", "parameter_hooks", "global_hooks", "saved_tensor_hooks", "dispatch_mode")
    for key in (*leftover, "function_modes", "grad"):
        assert equal(bare[key], watched[key]), f"{key} differs"
