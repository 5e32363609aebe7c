"""Train twice, with and without the monitor, and compare everything the user could look at, exactly.

A case builds its module, DataLoader and the user's own objects from scratch for each run (the same seed), and
says what to read back from those objects (``observe``). Two monitor set-ups are tried: the CPU path (a replay at
the first sampled step) and the CUDA path through the scripted probe (a preflight replay before step 0 as well).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from models import trainer
from torch.utils.data import DataLoader

from lightning_vram import VramMonitor
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

PATHS = ("cpu", "cuda")


@dataclass
class Case:
    """What one run trains, and what the user would look at afterwards."""

    module: pl.LightningModule
    loader: DataLoader[Any]
    observe: Callable[[], Any] = lambda: None
    trainer_options: dict[str, Any] = field(default_factory=dict)
    before_monitor: list[pl.Callback] = field(default_factory=list)
    """The user's callbacks listed before the monitor (Lightning calls them first)."""
    after_monitor: list[pl.Callback] = field(default_factory=list)
    """The user's callbacks listed after the monitor."""


@dataclass
class Outcome:
    state: dict[str, torch.Tensor]
    optimizer_state: Any
    losses: list[torch.Tensor]
    generators: tuple[Any, ...]
    observed: Any
    monitor: VramMonitor | None


class LossRecorder(pl.Callback):
    """Keeps every step's loss (Lightning's own output of ``training_step``)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:  # a step that returned None (skipped)
            self.losses.append(loss.detach().clone())


def monitor_for(path: str, **options: Any) -> VramMonitor:
    """The monitor on the CPU path, or on the CUDA path through the scripted probe (preflight included)."""
    defaults: dict[str, Any] = {"attribution_start_step": 1, "console_summary": False}
    if path == "cuda":
        defaults["probe"] = ScriptedProbe([ScriptedBoundary(0, 0, 0)])
    defaults.update(options)
    return VramMonitor(**defaults)


def train(build: Callable[[], Case], root: Path, monitor: VramMonitor | None, steps: int = 4) -> Outcome:
    """Seed everything, build the case, train it, and read back what the user could look at."""
    pl.seed_everything(0, verbose=False)
    np.random.seed(0)
    case = build()
    recorder = LossRecorder()
    monitored: list[pl.Callback] = [monitor] if monitor is not None else []
    callbacks: list[pl.Callback] = [recorder, *case.before_monitor, *monitored, *case.after_monitor]
    run = trainer(root, callbacks, max_steps=steps, **case.trainer_options)
    run.fit(case.module, case.loader)
    optimizer = run.optimizers[0] if run.optimizers else None
    return Outcome(
        state={name: tensor.detach().clone() for name, tensor in case.module.state_dict().items()},
        optimizer_state=optimizer.state_dict() if optimizer is not None else None,
        losses=recorder.losses,
        generators=(torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tobytes()),
        observed=case.observe(),
        monitor=monitor,
    )


def equal(left: Any, right: Any) -> bool:
    """Exact equality through tensors, arrays, dicts, lists and tuples (bitwise for tensors)."""
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        return (
            isinstance(left, torch.Tensor)
            and isinstance(right, torch.Tensor)
            and type(left) is type(right)
            and left.dtype == right.dtype
            and left.shape == right.shape
            and torch.equal(left, right)
        )
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        return isinstance(left, np.ndarray) and isinstance(right, np.ndarray) and np.array_equal(left, right)
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(equal(left[key], right[key]) for key in left)
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return type(left) is type(right) and len(left) == len(right) and all(map(equal, left, right))
    return bool(left == right)


def assert_untouched(build: Callable[[], Case], root: Path, path: str, steps: int = 4, **options: Any) -> VramMonitor:
    """Train without and with the monitor on ``path``; every observable must be identical. Returns the monitor."""
    bare = train(build, root / "bare", None, steps)
    monitor = monitor_for(path, **options)
    watched = train(build, root / "watched", monitor, steps)
    assert equal(bare.losses, watched.losses), "losses differ"
    assert equal(bare.state, watched.state), "weights or buffers differ"
    assert equal(bare.optimizer_state, watched.optimizer_state), "optimizer state differs"
    assert equal(bare.generators, watched.generators), "a global random generator differs"
    assert equal(bare.observed, watched.observed), f"the user's objects differ: {bare.observed} != {watched.observed}"
    assert monitor.report is not None, "the monitor lost its report"
    return monitor
