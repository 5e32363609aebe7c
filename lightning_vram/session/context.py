"""The facts of one run, fixed when it starts: the model, its optimizers and device, ranks, and the training set-up."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_vram.measure.setup import fabric_unwrapped, session_loop, training_setup
from lightning_vram.prediction.containment.user_code import is_user_file
from lightning_vram.prediction.replay.step import StepFunction, lightning_training_step
from lightning_vram.records import TrainingSetup
from lightning_vram.session.accumulation import AccumulationWindows

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
        wrapper: returns the module training runs the model through (a ``DistributedDataParallel``), read on
            sampled steps and replays; ``None`` where there is none.
        windows: the accumulation window, declared and observed: :meth:`setup` carries it.
    """

    model: nn.Module | None = None
    optimizers: Optimizers = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    read_setup: Callable[[], TrainingSetup] | None = None
    step_function: StepFunction | None = None
    rank: int = 0
    world_size: int = 1
    wrapper: Callable[[], nn.Module | None] | None = None
    windows: AccumulationWindows = field(default_factory=AccumulationWindows)
    _setup: TrainingSetup | None = None

    def current_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers now (a callable is read again)."""
        optimizers = self.optimizers
        return list(optimizers() if callable(optimizers) else optimizers)

    def wrapped_by(self) -> nn.Module | None:
        """The module training runs the model through now (``None``: none known, or after close)."""
        return self.wrapper() if self.wrapper is not None else None

    def setup(self) -> TrainingSetup | None:
        """The training set-up, read once per epoch, the first time it is needed; ``None`` after close.

        Training has started then, and the epoch's window is set (a ``GradientAccumulationScheduler`` sets the
        Trainer's as the epoch starts; see :meth:`epoch_ended`).

        Its ``accumulate_grad_batches`` is the window observed so far, else the declared one, else the set-up's own
        (:meth:`AccumulationWindows.window`).

        Raises:
            Exception: whatever reading it raised; the caller's guard handles it, and the next call reads again.
        """
        if self._setup is None and self.read_setup is not None:
            self._setup = self.read_setup()
        setup = self._setup
        if setup is None:
            return None
        window = self.windows.window(setup.accumulate_grad_batches)
        return setup if window == setup.accumulate_grad_batches else replace(setup, accumulate_grad_batches=window)

    def epoch_ended(self) -> None:
        """An epoch ended: the next :meth:`setup` reads the set-up again (the next epoch's window may differ)."""
        self._setup = None

    def release(self) -> None:
        """Let go of the model, its optimizers and the callables that may hold a Trainer (and its process group)."""
        self.model, self.optimizers, self.read_setup, self.step_function = None, (), None, None
        self.wrapper = None


def run_context(
    model: nn.Module,
    optimizers: Optimizers,
    dataloader: Any,
    precision: str,
    device: torch.device | None,
    setup: Callable[[], TrainingSetup] | None,
    step_function: StepFunction | None,
    accumulate_grad_batches: int | None = None,
) -> RunContext:
    """The facts of a run as ``VramSession.start`` takes them (checked).

    The device defaults to the model's, the set-up to one read from the model, optimizers, ``dataloader`` and
    ``precision`` (a plain loop, or Fabric where Fabric wrapped any of them), the step function to a
    LightningModule's ``training_step``. ``accumulate_grad_batches``: the window declared (``None``: not declared),
    which the set-up carries until the loop's own is observed. A model Fabric wrapped (``fabric.setup``'s result) is
    measured as the module inside it (:func:`~lightning_vram.measure.setup.fabric_unwrapped`).
    """
    given, model = model, fabric_unwrapped(model)
    if step_function is None and callable(getattr(model, "training_step", None)):
        step_function = lightning_training_step
    context = RunContext(
        model,
        optimizers,
        device if device is not None else model_device(model),
        step_function=step_function,
        windows=AccumulationWindows(accumulate_grad_batches, from_setup=setup is not None),
    )
    context.read_setup = setup or (
        lambda: training_setup(
            model,
            optimizers := context.current_optimizers(),
            dataloaders=dataloader,
            precision=precision,
            loop=session_loop(given, optimizers, dataloader),
        )
    )
    return context


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
