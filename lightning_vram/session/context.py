"""The facts of one run, fixed when it starts: the model, its optimizers and device, ranks, and the training set-up."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_vram.advice.replay.step import StepFunction
from lightning_vram.measure.user_code import is_user_file
from lightning_vram.records import TrainingSetup

Optimizers = Sequence[torch.optim.Optimizer] | Callable[[], Sequence[torch.optim.Optimizer]]
"""A run's optimizers, or a callable returning them (read again each time they are needed)."""


@dataclass
class RunContext:
    """What every part of a run reads: set by ``VramSession.start``, let go of by ``close``.

    Args:
        model: the module trained.
        optimizers: its optimizers, or a callable returning them.
        device: the device measured.
        read_setup: returns the training set-up; read once, the first time a part needs it (see :meth:`setup`).
        step_function: ``(module, batch) -> loss`` for the replays; ``None`` where none can run.
        rank: this process's global rank.
        world_size: the number of processes training together.
    """

    model: nn.Module | None = None
    optimizers: Optimizers = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    read_setup: Callable[[], TrainingSetup] | None = None
    step_function: StepFunction | None = None
    rank: int = 0
    world_size: int = 1
    _setup: TrainingSetup | None = None

    def current_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers now (a callable is read again)."""
        optimizers = self.optimizers
        return list(optimizers() if callable(optimizers) else optimizers)

    def setup(self) -> TrainingSetup | None:
        """The training set-up, computed once per run (the first time training has started); ``None`` after close.

        Raises:
            Exception: whatever reading it raised; the caller's guard handles it, and the next call reads again.
        """
        if self._setup is None and self.read_setup is not None:
            self._setup = self.read_setup()
        return self._setup

    def release(self) -> None:
        """Let go of the model, its optimizers and the callables that may hold a Trainer (and its process group)."""
        self.model, self.optimizers, self.read_setup, self.step_function = None, (), None, None


def model_device(model: nn.Module) -> torch.device:
    """A LightningModule's ``device``, else the device of the model's first parameter or buffer, else the CPU.

    A ``device`` property of the user's own class is not run (it may compute anything); Lightning's is.
    """
    device = inspect.getattr_static(model, "device", None)
    if isinstance(device, property) and isinstance(device.fget, types.FunctionType):
        device = None if is_user_file(device.fget.__code__.co_filename) else device.fget(model)
    if isinstance(device, torch.device):
        return device
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")
