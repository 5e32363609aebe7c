"""The pieces of one replayed training step: the step as Lightning runs it, and what rules a replay out.

The step follows Lightning's automatic optimization: ``training_step`` (under the precision's forward context),
``optimizer_zero_grad`` (``set_to_none`` by default), backward, each optimizer's ``step``
(:meth:`StepRun.run_step`), with an accumulation window's micro-batches as Lightning runs them (the loss divided by
``accumulate_grad_batches``, ``zero_grad`` in the window's first only: :meth:`StepRun.run_micro_batch`); or, under
manual optimization, ``training_step`` alone, on the copy's own optimizers and backward
(:mod:`~lightning_vram.prediction.replay.manual`). Backward is autograd's engine, except on fake CUDA without a CUDA
device, where the engine cannot run and the graph is walked in Python
(:mod:`~lightning_vram.prediction.replay.backward`). Only the replay's fake copy runs
(:mod:`~lightning_vram.prediction.replay.twin`); :class:`~lightning_vram.prediction.predictor.Predictor` puts the
pieces together, contained.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from lightning_vram.measure.tensors import batch_size_of, time_major
from lightning_vram.prediction.containment.code_roots import (
    data_roots,
    inside_ids,
    instance_roots,
)
from lightning_vram.prediction.containment.containment import (
    OUTSIDE_TENSOR_BYTES,
)
from lightning_vram.prediction.containment.installed import installed_refusal
from lightning_vram.prediction.containment.reach import WALK_LIMIT, Reach, reach_of
from lightning_vram.prediction.replay._fake import FakeTensor
from lightning_vram.prediction.replay.backward import engine_can_run, graph_backward
from lightning_vram.prediction.replay.batches import (
    move_batch,
    resize_batch,
    resize_length,
    resize_shape,
    sequences_within,
)
from lightning_vram.prediction.replay.changes import change_module
from lightning_vram.prediction.replay.counting import ReplayCounter
from lightning_vram.prediction.replay.live import LiveMemory
from lightning_vram.prediction.replay.manual import bind_manual
from lightning_vram.prediction.replay.precision import PrecisionPlan
from lightning_vram.prediction.replay.twin import (
    Twin,
    move_module,
)
from lightning_vram.records import (
    BatchSizeChange,
    LengthChange,
    Phase,
    StepChange,
    TokensPerBatchChange,
)

LOSS_OPS = frozenset({"_log_softmax"})
"""Ops whose saved outputs are the loss's own activations (cross-entropy's log-probabilities)."""
LOSS_READERS = frozenset({"nll_loss_forward", "nll_loss2d_forward"})
"""Ops that make a log-softmax's output cross-entropy's (``F.cross_entropy`` and ``F.nll_loss`` run them)."""

StepFunction = Callable[[nn.Module, Any], Any]
"""Runs the training step on the replay's module and batch; returns the loss, or a dict with ``"loss"``."""


BATCH_INDEX: ContextVar[int] = ContextVar("lightning_vram_replay_batch_index", default=0)
"""The ``batch_idx`` :func:`lightning_training_step` passes: set by :meth:`StepRun.run_micro_batch` around each
replayed micro-batch (0, a window's first; ``accumulate_grad_batches - 1``, the one whose optimizer steps)."""


def lightning_training_step(module: nn.Module, batch: Any) -> Any:
    """Call ``module.training_step`` as Lightning does: with ``batch_idx`` when its signature takes one.

    ``batch_idx`` is :data:`BATCH_INDEX`'s: a step that reads it (``set_requires_gradient_sync(batch_idx % 2 == 1)``
    under FSDP2) runs in the replay as it runs at that place of an accumulation window.
    """
    training_step = getattr(module, "training_step", None)
    if not callable(training_step):
        raise TypeError(f"{type(module).__name__} has no training_step: pass step_function")
    parameters = inspect.signature(training_step).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_index = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
    return training_step(batch, BATCH_INDEX.get()) if takes_index else training_step(batch)


def loss_of(output: Any) -> Tensor:
    """The loss in a training step's output (a tensor, or a mapping with ``"loss"``); ``TypeError`` without one."""
    if isinstance(output, Mapping):
        output = output.get("loss")
    if not isinstance(output, Tensor):
        raise TypeError(f"training_step returned {type(output).__name__}, not a loss: Lightning skips such a step")
    return output


def _zero_grad(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Lightning's ``optimizer_zero_grad`` hook of the (fake) module, or the optimizers' own ``zero_grad``."""
    hook = getattr(module, "optimizer_zero_grad", None)
    for optimizer in optimizers:
        if callable(hook):
            hook(0, 0, optimizer)
        else:
            optimizer.zero_grad()


class StepRun:
    """One replay's settings: the precision, the change, the step function and the counted device."""

    def __init__(
        self,
        device: torch.device,
        precision: PrecisionPlan,
        change: StepChange | None,
        step_function: StepFunction,
        placement: torch.device | None,
        shape: tuple[int, ...] | None = None,
        accumulate: int = 1,
    ) -> None:
        self.shape = shape
        self.accumulate = accumulate
        """``accumulate_grad_batches``: micro-batches whose gradients add up before each optimizer step."""
        self.device = device
        self.precision = precision
        self.change = change
        self.step_function = step_function
        self.placement = placement
        self.checkpoint_frames: Callable[[], Iterable[Any]] = tuple
        """The replay's checkpoint frames alive now, handed to a backward walked without the engine."""
        self.phase: Phase | None = None
        """The phase the step runs now (``None`` before its first forward): where a replay that raised stopped."""

    def prepare_module(self, module: nn.Module) -> None:
        """Move the fake ``module`` to the placement, cast it for the precision, apply the change."""
        if self.placement is not None:
            move_module(module, self.placement)
        self.precision.cast_module(module)
        change_module(module, self.change)

    def prepare_batch(self, batch: Any) -> Any:
        """The fake batch resized as the shape and the change ask, moved to the placement, cast for the precision."""
        change = self.change
        if self.shape is not None:
            batch = resize_shape(batch, self.shape)
        if isinstance(change, LengthChange):
            batch = resize_length(batch, change.length)
        if isinstance(change, BatchSizeChange | TokensPerBatchChange):
            size = batch_size_of(batch)
            if size is None:
                raise ValueError("the batch has no tensor with a batch dimension to resize")
            reversed_batch = time_major(batch)
            if reversed_batch is not None:
                raise ValueError(f"the batch's first dimension is not its batch: {reversed_batch}")
            kept = change.batch_size if isinstance(change, BatchSizeChange) else sequences_within(batch, change.tokens)
            batch = resize_batch(batch, size, kept)
        if self.placement is not None:
            batch = move_batch(batch, self.placement)
        return self.precision.cast_batch(batch)

    def run_micro_batch(
        self,
        twin: Twin,
        batch: Any,
        counter: ReplayCounter | None,
        live: LiveMemory | None,
        zero_grad: bool = True,
        stepping: bool = False,
    ) -> None:
        """Forward, zero_grad (the first micro-batch of a window only) and backward, with the counters told.

        Under accumulation the loss is divided by ``accumulate`` as Lightning divides it; the optimizer does not step.
        ``stepping``: the micro-batch ends in the optimizer's step, so ``training_step`` is given ``batch_idx``
        ``accumulate - 1`` (the window's last, as Lightning numbers it from 0 in a window-aligned epoch); otherwise 0,
        the window's first.
        """
        self.phase = Phase.FORWARD
        if counter is not None and live is not None:
            counter.begin_forward()
            live.start_phase(Phase.FORWARD)
        index = BATCH_INDEX.set(self.accumulate - 1 if stepping else 0)
        try:
            with self.precision.forward_context(self.device.type):
                output = self.step_function(self.precision.scoped(twin.module, self.device.type), batch)
        finally:
            BATCH_INDEX.reset(index)
        loss = loss_of(output)
        if self.accumulate > 1:
            loss = loss / self.accumulate  # not in place, as Lightning divides it
        if zero_grad:
            _zero_grad(twin.module, twin.optimizers)
        self.phase = Phase.BACKWARD
        if counter is not None and live is not None:
            counter.before_backward()
            live.start_phase(Phase.BACKWARD)
        self.backward(loss)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward from ``loss``: autograd's engine, or the graph walked where the engine cannot run.

        ``args``, ``kwargs``: as ``Tensor.backward`` takes them (``retain_graph``), for the engine.
        """
        if engine_can_run(self.device):
            loss.backward(*args, **kwargs)  # type: ignore[no-untyped-call]  # torch ships it unannotated here
        else:  # fake CUDA without a CUDA device: autograd's engine cannot run (replay/backward.py)
            graph_backward(loss, self.checkpoint_frames())

    def run_step(
        self, twin: Twin, batch: Any, counter: ReplayCounter | None, live: LiveMemory | None, zero_grad: bool = True
    ) -> None:
        """Forward, zero_grad, backward and optimizer step, with the counters told of each boundary.

        ``zero_grad=False``: a later micro-batch of an accumulation window, whose backward adds to the gradients.
        Under manual optimization the user's ``training_step`` runs alone, calling backward and the optimizers as it
        does (:meth:`run_manual`).
        """
        if getattr(twin.module, "automatic_optimization", True) is False:
            self.run_manual(twin, batch, counter, live)
            return
        self.run_micro_batch(twin, batch, counter, live, zero_grad, stepping=True)
        self.phase = Phase.OPTIMIZER
        if counter is not None and live is not None:
            counter.before_optimizer_step()
            live.start_phase(Phase.OPTIMIZER)
        for optimizer in twin.optimizers:
            optimizer.step()

    def run_manual(self, twin: Twin, batch: Any, counter: ReplayCounter | None, live: LiveMemory | None) -> None:
        """``training_step`` under manual optimization, on the copy's own optimizers and backward.

        Each ``manual_backward`` is a backward segment and each optimizer's update an optimizer one, as the monitor's
        hooks count a manual step (:class:`~lightning_vram.measure.accounting.StepAttributor`): the code before a
        backward is a forward pass, the code after a backward or an update that no backward follows counts with
        that phase.
        """

        def before_backward() -> None:
            self.phase = Phase.BACKWARD
            if counter is not None and live is not None:
                counter.before_backward()
                live.start_phase(Phase.BACKWARD, ended=Phase.FORWARD)

        def after_backward() -> None:
            if counter is not None and live is not None:
                counter.after_backward()
                live.start_phase(Phase.BACKWARD)

        def before_step() -> None:
            self.phase = Phase.OPTIMIZER
            if counter is not None and live is not None:
                counter.before_optimizer_step()
                live.start_phase(Phase.OPTIMIZER)

        def after_step() -> None:
            if counter is not None and live is not None:
                counter.after_optimizer_step()
                live.start_phase(Phase.OPTIMIZER)

        bind_manual(
            twin.module, twin.optimizers, self.backward, before_backward, before_step, after_backward, after_step
        )
        self.phase = Phase.FORWARD
        if counter is not None and live is not None:
            counter.begin_forward()
            live.start_phase(Phase.FORWARD)
        with self.precision.forward_context(self.device.type):
            self.step_function(self.precision.scoped(twin.module, self.device.type), batch)


def release_frames(error: BaseException) -> None:
    """Clear the locals of every frame ``error`` (and what it chains) passed through.

    An error raised inside autograd's engine (a replay's deadline during backward) is kept by C++ beyond the
    ``except`` clause; its frames would keep the replay's copy, its graph and its fake tensors alive.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def drain_autograd() -> None:
    """Run one tiny backward on the CPU, so that autograd lets go of a replay's graph that stopped in backward.

    A backward that raised (a replay's deadline) leaves its pending tasks in this thread's ready queue, holding the
    graph and its fake tensors, until the next backward drains it.
    """
    with torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        (leaf * 1.0).backward()  # type: ignore[no-untyped-call]  # torch ships Tensor.backward unannotated here


def release_gradients(twin: Twin) -> None:
    """Take the gradients off the replay's copy of the module (each parameter's ``.grad`` set to ``None``).

    A step's ``backward(create_graph=True)`` (a double backward) gives each parameter a gradient whose graph holds
    the parameter: a cycle through autograd's C++ that the garbage collector cannot see. The replay's own
    ``zero_grad`` breaks it where the step ran to its end; where it stopped half-way (it raised: a warning the
    filters made an error), the copy's fake tensors outlived the replay and the escape check raised out of
    ``predict()``.
    """
    for parameter in twin.module.parameters():
        parameter.grad = None


class RefusedError(Exception):
    """What the copy of the module holds rules the replay out (its message says why)."""


def held_by(copy: nn.Module, inside: set[int], own: Iterable[object] = (), after: Reach | None = None) -> Reach:
    """What the replay's ``copy`` of the module shares with the user's objects, found on the copy itself.

    Its hooks and callables (a function closing over the real module reaches it), and what ``deepcopy`` shared
    instead of copying (an ``lru_cache`` it copied as a fresh one: :mod:`~.hook_free`). ``own``:
    the replay's own objects, not walked (its fake mode, which a fake tensor the copy's hooks hold names: its
    converter's memo is keyed by the real tensors the copy was made from). ``after``: the walk of the step's code
    (from its classes), whose names in reach this walk goes on from (see :func:`~.reach.reach_of`).
    """
    ignore = inside_ids(copy) | {id(o) for o in own}
    held = reach_of(instance_roots(copy), inside, data_roots(copy), ignore=ignore, after=after)
    held.tensors = [tensor for tensor in held.tensors if not isinstance(tensor, FakeTensor)]
    return held


def compiled_refusal(compiled: str) -> str:
    """Why a step whose code calls ``compiled`` (what ``torch.compile`` made, and where it was found) is not run.

    Dynamo keeps what it makes of a call per code object, for every later call: a replay's call on fake tensors left
    the user's function running eagerly for the rest of the process (torch 2.13), or would add a cache entry that
    counts against its recompile limit.
    """
    return (
        f"the step's code calls {compiled}, compiled by torch.compile: a replay would run it through dynamo on fake"
        " tensors, and dynamo keeps what it makes of a call (a graph, or a mark that runs the function eagerly from"
        " then on) for training's later calls"
    )


def refusal_of(reach: Reach) -> str | None:
    """Why the code ``reach`` describes must not be replayed, decided before it runs; ``None`` when it may."""
    installed = installed_refusal(reach.installed)
    if installed is not None:
        return installed
    if reach.real_modules:
        path = reach.real_modules[0]
        swept = next((what for start, what in reach.sweeps.items() if path.startswith(start)), None)
        if swept is not None:  # what the code does, rather than a global it never names
            return (
                f"the step's code ({swept}) reaches every global of its module, and through them the trained model"
                f" itself ({path}), which a replay must not run"
            )
        return (
            f"the step's code reaches the trained model itself ({reach.real_modules[0]}), which a replay must not"
            " run: a step_function should call the module it is given"
        )
    if reach.hook_apis:
        return (
            f"the step's code uses {', '.join(sorted(reach.hook_apis))}, which refuses or hides the saved-tensor hooks"
            " a replay counts with"
        )
    if reach.compiled:
        return compiled_refusal(reach.compiled[0])
    if not reach.complete:
        return (
            f"the step's code reaches more than {WALK_LIMIT} objects beyond the module; a replay could not save and"
            " put back all of them"
        )
    if reach.effects:
        return (
            f"the step's code ({reach.effects[0]}) acts outside the objects a replay saves and puts back: a replay"
            " would do it again"
        )
    if reach.unrestorable:
        return f"the step's code reaches {reach.unrestorable[0]}, whose state a replay cannot save and put back"
    with torch._C.DisableTorchFunctionSubclass():  # a tensor subclass's __torch_function__ is the user's code
        tensor_bytes = sum(tensor.untyped_storage().nbytes() for tensor in reach.tensors)
    if tensor_bytes > OUTSIDE_TENSOR_BYTES:
        return (
            f"the step's code reaches {tensor_bytes} bytes of tensors held outside the module; a replay saves at most"
            f" {OUTSIDE_TENSOR_BYTES} bytes to put back what it changes in place"
        )
    return None
