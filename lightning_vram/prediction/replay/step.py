"""One training step replayed under fake tensors, counted as the monitor counts a sampled step.

The step follows Lightning's automatic optimization: ``training_step`` (under the precision's forward context),
``optimizer_zero_grad`` (``set_to_none`` by default), backward, each optimizer's ``step``. Only the replay's fake
copy runs (:mod:`~lightning_vram.prediction.replay.twin`); process-wide state is restored
afterwards (:mod:`~lightning_vram.prediction.containment.isolation`). Whatever fails (an op without a fake kernel,
a value read with ``.item()``, a shape that depends on data) ends the replay with a
:class:`~lightning_vram.records.ReplaySkipped` saying why: :func:`replay_step` never raises.
"""

from __future__ import annotations

import functools
import inspect
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_vram.measure.compiled import compiled_callable_name, compiled_module_names
from lightning_vram.measure.tensors import batch_size_of, iter_tensors
from lightning_vram.prediction.containment.checkpoint_frames import CheckpointFrames
from lightning_vram.prediction.containment.code_roots import (
    code_roots,
    data_roots,
    hook_registries,
    inside_ids,
    instance_roots,
)
from lightning_vram.prediction.containment.containment import (
    OUTSIDE_TENSOR_BYTES,
    ContainmentError,
    contained,
    fresh_cache,
)
from lightning_vram.prediction.containment.deadline import Deadline
from lightning_vram.prediction.containment.escapes import register
from lightning_vram.prediction.containment.isolation import isolated
from lightning_vram.prediction.containment.reach import WALK_LIMIT, Reach, reach_of
from lightning_vram.prediction.replay._fake import FakeTensor, FakeTensorMode
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
from lightning_vram.prediction.replay.known_values import KnownValues
from lightning_vram.prediction.replay.live import LiveMemory
from lightning_vram.prediction.replay.precision import PrecisionPlan, precision_plan
from lightning_vram.prediction.replay.real_branches import real_branches
from lightning_vram.prediction.replay.skips import skip_reason
from lightning_vram.prediction.replay.timeline import TimelineRecorder
from lightning_vram.prediction.replay.twin import (
    Twin,
    make_twin,
    module_device,
    move_module,
    shared_arrays,
    state_tensors,
)
from lightning_vram.prediction.replay.workspaces import WorkspaceProbe
from lightning_vram.records import (
    BatchSizeChange,
    FreeGradientsChange,
    LengthChange,
    Phase,
    PhasePeak,
    PrecisionChange,
    ReplayedStep,
    ReplaySkipped,
    StepChange,
    TokensPerBatchChange,
)

LOSS_OPS = frozenset({"_log_softmax"})
"""Ops whose saved outputs are the loss's own activations (cross-entropy's log-probabilities)."""

StepFunction = Callable[[nn.Module, Any], Any]
"""Runs the training step on the replay's module and batch; returns the loss, or a dict with ``"loss"``."""


def lightning_training_step(module: nn.Module, batch: Any) -> Any:
    """Call ``module.training_step`` as Lightning does: with ``batch_idx`` when its signature takes one."""
    training_step = getattr(module, "training_step", None)
    if not callable(training_step):
        raise TypeError(f"{type(module).__name__} has no training_step: pass step_function")
    parameters = inspect.signature(training_step).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_index = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
    return training_step(batch, 0) if takes_index else training_step(batch)


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


class _Run:
    """One replay's settings: the precision, the change, the step function and the counted device."""

    def __init__(
        self,
        device: torch.device,
        precision: PrecisionPlan,
        change: StepChange | None,
        step_function: StepFunction,
        placement: torch.device | None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.shape = shape
        self.device = device
        self.precision = precision
        self.change = change
        self.step_function = step_function
        self.placement = placement
        self.checkpoint_frames: CheckpointFrames | None = None
        """The replay's record of checkpoint frames, handed to a backward walked without the engine."""

    def prepare_module(self, module: nn.Module) -> None:
        if self.placement is not None:
            move_module(module, self.placement)
        self.precision.cast_module(module)
        change_module(module, self.change)

    def prepare_batch(self, batch: Any) -> Any:
        change = self.change
        if self.shape is not None:
            batch = resize_shape(batch, self.shape)
        if isinstance(change, LengthChange):
            batch = resize_length(batch, change.length)
        if isinstance(change, BatchSizeChange | TokensPerBatchChange):
            size = batch_size_of(batch)
            if size is None:
                raise ValueError("the batch has no tensor with a batch dimension to resize")
            kept = change.batch_size if isinstance(change, BatchSizeChange) else sequences_within(batch, change.tokens)
            batch = resize_batch(batch, size, kept)
        if self.placement is not None:
            batch = move_batch(batch, self.placement)
        return self.precision.cast_batch(batch)

    def run_step(self, twin: Twin, batch: Any, counter: ReplayCounter | None, live: LiveMemory | None) -> None:
        """Forward, zero_grad, backward and optimizer step, with the counters told of each boundary."""
        if counter is not None and live is not None:
            counter.begin_forward()
            live.start_phase(Phase.FORWARD)
        with self.precision.forward_context(self.device.type):
            output = self.step_function(twin.module, batch)
        loss = loss_of(output)
        _zero_grad(twin.module, twin.optimizers)
        if counter is not None and live is not None:
            counter.before_backward()
            live.start_phase(Phase.BACKWARD)
        if engine_can_run(self.device):
            loss.backward()  # type: ignore[no-untyped-call]  # torch ships Tensor.backward unannotated here
        else:
            graph_backward(loss, self.checkpoint_frames.recorded() if self.checkpoint_frames is not None else ())
        if counter is not None and live is not None:
            counter.before_optimizer_step()
            live.start_phase(Phase.OPTIMIZER)
        for optimizer in twin.optimizers:
            optimizer.step()


def _release_frames(error: BaseException) -> None:
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


def _drain_autograd() -> None:
    """Run one tiny backward on the CPU, so that autograd lets go of a replay's graph that stopped in backward.

    A backward that raised (a replay's deadline) leaves its pending tasks in this thread's ready queue, holding the
    graph and its fake tensors, until the next backward drains it.
    """
    with torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        (leaf * 1.0).backward()  # type: ignore[no-untyped-call]  # torch ships Tensor.backward unannotated here


class _RefusedError(Exception):
    """What the copy of the module holds rules the replay out (its message says why)."""


def _held_by(copy: nn.Module, inside: set[int]) -> Reach:
    """What the replay's ``copy`` of the module shares with the user's objects, found on the copy itself.

    Its hooks and callables (a function closing over the real module reaches it), and what ``deepcopy`` shared
    instead of copying. Each ``functools.lru_cache`` the copy holds as an attribute becomes a fresh one.
    """
    for child in copy.modules():
        attributes = vars(child)
        for name, value in list(attributes.items()):
            if isinstance(value, functools._lru_cache_wrapper):
                attributes[name] = fresh_cache(value)
    held = reach_of(instance_roots(copy), inside, data_roots(copy), ignore=inside_ids(copy))
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


def _refusal(reach: Reach) -> str | None:
    """Why the code ``reach`` describes must not be replayed, decided before it runs; ``None`` when it may."""
    if reach.real_modules:
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
        return (
            f"the step's code reaches {reach.unrestorable[0]}, whose state a replay cannot save and put back (what an"
            " iterator or a generator yielded to the replay would be missing from training)"
        )
    tensor_bytes = sum(tensor.untyped_storage().nbytes() for tensor in reach.tensors)
    if tensor_bytes > OUTSIDE_TENSOR_BYTES:
        return (
            f"the step's code reaches {tensor_bytes} bytes of tensors held outside the module; a replay saves at most"
            f" {OUTSIDE_TENSOR_BYTES} bytes to put back what it changes in place"
        )
    return None


def replay_step(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] | None,
    batch: Any,
    *,
    precision: str = "32-true",
    change: StepChange | None = None,
    device: torch.device | None = None,
    step_function: StepFunction = lightning_training_step,
    warm_up: bool = False,
    step: int = 0,
    placement: torch.device | None = None,
    gradients_at_forward: bool = True,
    deadline: float | None = None,
    shape: tuple[int, ...] | None = None,
) -> ReplayedStep | ReplaySkipped:
    """Replay one training step of ``module`` on fake tensors and count it.

    The user's code runs on the replay's copies; what it can reach beyond them is saved and put back
    (:mod:`~lightning_vram.prediction.containment`). A step whose code reaches the trained model itself is not
    replayed. The only error raised is :class:`~lightning_vram.prediction.containment.containment.ContainmentError`,
    when
    something outside could not be put back; every other failure is a :class:`ReplaySkipped`.

    Args:
        module: the module trained (a LightningModule, or any module with ``step_function``); left untouched.
        optimizers: its optimizers: each is rebuilt from its class and param groups, its state faked; ``None``
            builds them with the module's ``configure_optimizers`` on the replay's fake parameters.
        batch: a batch as ``training_step`` receives it (on the training device); only shapes and dtypes are used.
        precision: the run's precision, as Lightning names it; a :class:`PrecisionChange` replaces it.
        change: one change to replay (``None``: the step as it is).
        device: the device whose memory is counted; default: where the module's first parameter is.
        step_function: runs the training step; default: ``module.training_step(batch, batch_idx)``.
        warm_up: replay one uncounted step first, so that gradients and optimizer state exist as in a steady
            step (for a module that has not trained yet).
        step: the step number the result carries.
        placement: replay on this device rather than where the module is (its copy and the batch are moved there).
        gradients_at_forward: whether the previous step's gradients are alive when the forward pass starts, as under
            Lightning's default; ``False`` where the run frees them first (its own ``on_train_batch_start``).
        deadline: ``time.perf_counter()`` (seconds) past which the replay stops at its next op; ``None``: no limit.
        shape: replay the batch resized to this shape past its batch dimension (see
            :func:`~lightning_vram.prediction.replay.batches.resize_shape`); ``None``: as it is.

    Returns:
        The replayed step, or why it could not be replayed.
    """
    started = time.perf_counter()
    if getattr(module, "automatic_optimization", True) is False:
        return ReplaySkipped("manual optimization: the replay reproduces Lightning's automatic optimization only")
    try:
        plan = precision_plan(change.precision if isinstance(change, PrecisionChange) else precision)
    except ValueError as error:
        return ReplaySkipped(str(error))
    compiled = compiled_module_names(module)
    if compiled:  # predict() on a compiled model: the session's own replays stop before this
        wrapper = module.get_submodule(compiled[0])
        return ReplaySkipped(compiled_refusal(f"{compiled_callable_name(wrapper)} ({compiled[0] or 'the model'})"))
    counted_device = device or placement or module_device(module)
    run = _Run(counted_device, plan, change, step_function, placement, shape)
    shared = [*shared_arrays(module), *shared_arrays(batch)]
    inside = inside_ids(module)
    reach = reach_of(code_roots(module, step_function, optimizers or (), batch), inside)
    reach.objects.extend(hook_registries())  # a global hook the step registers is registered again by the replay
    refusal = _refusal(reach)
    if refusal is not None:
        return ReplaySkipped(refusal)
    counter: ReplayCounter | None = None
    frames = CheckpointFrames()
    run.checkpoint_frames = frames
    try:
        reach.arrays += shared
        with isolated(), contained(reach) as containment, frames:  # the copy's configure_optimizers is user code too
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            register(mode)
            optimizer_list = None if optimizers is None else list(optimizers)
            twin = make_twin(module, optimizer_list, batch, mode, run.prepare_module, {id(a): a for a in shared})
            held = _held_by(twin.module, inside)
            refusal = _refusal(held)
            if refusal is not None:
                raise _RefusedError(refusal)
            values = KnownValues()
            values.know(twin.batch_values)
            with contained(held) as held_containment, mode, Deadline(deadline), values, real_branches(values):
                fake_batch = run.prepare_batch(twin.batch)
                if warm_up:
                    run.run_step(twin, fake_batch, None, None)
                if isinstance(change, FreeGradientsChange) or not gradients_at_forward:
                    for parameter in twin.module.parameters():
                        parameter.grad = None
                live = LiveMemory(counted_device)
                live.track(state_tensors(twin))
                live.track([*iter_tensors(fake_batch), *twin.batch_tensors])
                counter = ReplayCounter(twin.module, twin.optimizers, counted_device, live.producer, LOSS_OPS)
                live.add_listener(counter.on_output)
                timeline = TimelineRecorder(lambda: live.live_bytes, counter.live_parts, lambda: counter.current_module)
                live.add_sampler(timeline)
                probe = WorkspaceProbe()
                with probe, live:
                    run.run_step(twin, fake_batch, counter, live)
                phases, modules = counter.finish()
    except ContainmentError:
        raise
    except _RefusedError as refused:
        return ReplaySkipped(str(refused), time.perf_counter() - started)
    except Exception as error:  # noqa: BLE001 -- the user's step on fake tensors: any failure is a reason to skip
        _release_frames(error)
        frames.release()
        _drain_autograd()
        return ReplaySkipped(skip_reason(error), time.perf_counter() - started)
    finally:
        if counter is not None:
            counter.close()
    return ReplayedStep(
        device_type=counted_device.type,
        precision=plan.name,
        batch_size=batch_size_of(fake_batch),
        phases={
            phase: PhasePeak(
                step=step,
                phase=phase,
                peak_bytes=live.phase_peaks[phase],
                reserved_bytes=None,
                breakdown=breakdown.with_measured_peak(live.phase_peaks[phase]),
            )
            for phase, breakdown in phases.items()
        },
        modules=modules,
        loss_activation_bytes=counter.loss_activation_bytes,
        seconds=time.perf_counter() - started,
        notes=(
            *(
                f"{op} keeps a workspace for backward that fake tensors do not size: left out"
                for op in sorted(probe.unmeasured)
            ),
            *(
                f"the replayed code changed {place}; put back as it was"
                for place in (*containment.restored, *held_containment.restored)
            ),
        ),
        timeline=timeline.finish(),
    )
