"""One object per round of replays: what every replay of a run's step shares, and the questions a caller asks it.

A :class:`Predictor` holds the trained module, its optimizers and the batch (each replay makes its own fake copy
of them: a variant changes the copy, and the step changes its optimizer state), the precision, the placement and
the counted device, the step function, the time budget, the containment decision (the walk of what the user's
code reaches, made once) and the calibration (the sampled step's counts, when there are some; on a device with
allocator readings, its measured peaks, whose excess over the replay is carried into every later replay: see
:mod:`~lightning_vram.prediction.replay.calibration`). A caller asks it for
the baseline step, a variant (a :class:`~lightning_vram.records.StepChange`), a batch size, the whole simulation
(:meth:`Predictor.simulate`) or the fit table (:meth:`Predictor.fit_table`).

Whatever fails inside a replay (an op without a fake kernel, a value read with ``.item()``, a shape that depends on
data) ends it with a :class:`~lightning_vram.records.ReplaySkipped` saying why. The only error raised is
:class:`~lightning_vram.prediction.containment.containment.ContainmentError`, when something outside could not be
put back.
"""

from __future__ import annotations

import contextvars
import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_vram.measure.compiled import compiled_callable_name, compiled_module_names
from lightning_vram.measure.scripted import scripted_refusal
from lightning_vram.measure.tensors import batch_size_of, iter_tensors
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.audit import (
    OutsideEffects,
    OutsideEffectsRepeated,
    audit_refusal,
    refusing_outside_effects,
)
from lightning_vram.prediction.containment.checkpoint_frames import CheckpointFrames
from lightning_vram.prediction.containment.code_roots import code_roots, hook_registries, inside_ids
from lightning_vram.prediction.containment.collectives import without_collectives
from lightning_vram.prediction.containment.containment import ContainmentError, contained
from lightning_vram.prediction.containment.deadline import Deadline
from lightning_vram.prediction.containment.escapes import register
from lightning_vram.prediction.containment.isolation import isolated
from lightning_vram.prediction.containment.reach import Reach, reach_of
from lightning_vram.prediction.devices import COMMON_GPUS
from lightning_vram.prediction.replay._fake import FakeTensorMode
from lightning_vram.prediction.replay.baseline import BASELINE_TOLERANCE
from lightning_vram.prediction.replay.calibration import carry
from lightning_vram.prediction.replay.changes import checkpointed_calls, release_plan
from lightning_vram.prediction.replay.counting import ReplayCounter
from lightning_vram.prediction.replay.cuda_kernels import CudaKernels
from lightning_vram.prediction.replay.fit_table import FitSearch, replayed_fit_table
from lightning_vram.prediction.replay.flops import StepFlops
from lightning_vram.prediction.replay.hook_free import HookedCopyError
from lightning_vram.prediction.replay.inplace_reads import LaterReads, read_later_reason
from lightning_vram.prediction.replay.known_values import KnownValues, TakenValues
from lightning_vram.prediction.replay.library_workspaces import LibraryWorkspaces
from lightning_vram.prediction.replay.live import AllocationListener, LiveMemory
from lightning_vram.prediction.replay.norm_dtypes import MixedNormDtypes
from lightning_vram.prediction.replay.optimizers import OptimizerShape
from lightning_vram.prediction.replay.precision import (
    SPANNING_AUTOCAST_NOTE,
    PrecisionPlan,
    autocast_spans_the_replay,
    outside_autocast,
    precision_plan,
)
from lightning_vram.prediction.replay.real_branches import real_branches
from lightning_vram.prediction.replay.reserved import ReservedPeaks, run_settings
from lightning_vram.prediction.replay.simulation import simulate
from lightning_vram.prediction.replay.skips import (
    ANOMALY_NOTE,
    PROFILER_SKIP,
    closure_refusal,
    profiler_recording,
    skip_reason,
    sparse_refusal,
)
from lightning_vram.prediction.replay.step import (
    LOSS_OPS,
    LOSS_READERS,
    RefusedError,
    StepFunction,
    StepRun,
    compiled_refusal,
    drain_autograd,
    held_by,
    lightning_training_step,
    refusal_of,
    release_frames,
    release_gradients,
)
from lightning_vram.prediction.replay.timeline import TimelineRecorder
from lightning_vram.prediction.replay.twin import (
    Twin,
    gradient_blocks,
    make_twin,
    module_device,
    optimizer_state_blocks,
    shared_arrays,
    state_tensors,
)
from lightning_vram.prediction.replay.unit_calls import Call, CallRecorder, changed_unit
from lightning_vram.prediction.replay.workspaces import WorkspaceProbe
from lightning_vram.records import (
    Attribution,
    BatchSizeChange,
    Breakdown,
    Calibration,
    CheckpointChange,
    FreeGradientsChange,
    InplaceChange,
    Phase,
    PhasePeak,
    PrecisionChange,
    ReplayedStep,
    ReplaySkipped,
    Simulation,
    StepChange,
    StrategyBuffers,
)


@dataclass(frozen=True)
class _Scope:
    """What the user's code reaches beyond the module (walked once), the module's own objects, the shared arrays."""

    reach: Reach
    inside: set[int]
    shared: list[Any]


class Predictor:
    """Replays of one run's training step, sharing everything but the change each one tries.

    Args:
        module: the module trained (a LightningModule, or any module with ``step_function``); left untouched.
        optimizers: its optimizers: each replay rebuilds them from their class and param groups, their state faked;
            ``None`` builds them with the module's ``configure_optimizers`` on the replay's fake parameters.
        batch: a batch as ``training_step`` receives it (on the training device); only shapes and dtypes are used.
        precision: the run's precision, as Lightning names it; a :class:`PrecisionChange` replaces it.
        device: the device whose memory is counted; default: ``placement``, else where the module's first parameter
            is.
        placement: replay on this device rather than where the module is (its copy and the batch are moved there).
        step_function: runs the training step; default: ``module.training_step(batch, batch_idx)``.
        warm_up: replay one uncounted step first, so that gradients and optimizer state exist as in a steady step
            (for a module that has not trained yet).
        shape: replay the batch resized to this shape past its batch dimension (see
            :func:`~lightning_vram.prediction.replay.batches.resize_shape`); ``None``: as it is.
        budget_seconds: host seconds for every replay asked of this predictor, counted from its creation: a replay
            running when they end stops at its next op. ``None``: no limit.
        calibration: the sampled step's counts (the baseline is checked against them); ``None`` before any.
        released_late: of each of the sampled step's live peaks, the bytes another thread freed after the step's code
            had let go of them (gloo's worker thread; :meth:`~lightning_vram.measure.live.LiveTensors.released_late`),
            read when the baseline is checked: the replay is held to each peak with and without them. Default: none.
        gradients_at_forward: whether the previous step's gradients are alive when the forward pass starts, as
            under Lightning's default; ``False`` where the run frees them first. ``None``: as the calibration's
            forward pass had them (alive without a calibration).
        clock: the host clock the budget is read from, in seconds (tests script it).
        allocations: makes a fresh listener for each replay, told of the replay's allocations and frees on the
            counted device, storage by storage, and of each phase's start; on CUDA, of the cuBLAS workspaces too.
            It takes the place of the allocator model. ``None``: the model, where ``allocator`` has settings.
        compute_capability: the CUDA device's, which sizes cuBLAS's workspace (``None``: unknown, 9.0's assumed).
        allocator: the caching allocator's settings each replay's sequence is run through, for the reserved peak of
            each phase (:class:`~lightning_vram.prediction.replay.reserved.ReservedPeaks`); default: on CUDA the
            run's own (``PYTORCH_ALLOC_CONF``), elsewhere none (the CPU has no caching allocator: no reserved
            figure).
        measured: the sampled step's allocator peaks per phase (``peak_bytes`` allocated, ``reserved_bytes`` the
            reserve at the phase's end), which :meth:`simulate` sets the baseline against (:attr:`carried`);
            ``None`` where there are none (the CPU, preflight, ``predict()``).
        strategy: what a multi-process strategy holds on this rank beyond the step (DDP's gradient buckets): each
            replay allocates its buffers before the step and holds them to its end, so they are in every phase's
            peak and ``other`` (and in the allocator model's sequence). ``None``: nothing.
        shard: applied to each replay's fake module after the step's own changes, before its optimizers are built
            (FSDP2's ``fully_shard`` under a fake process group: see
            :mod:`~lightning_vram.prediction.strategies.fsdp2`). ``None``: nothing.
        accumulate: ``accumulate_grad_batches``. Above 1 a replay runs two micro-batches of a window: the first
            (its gradients set to ``None`` before backward, as Lightning's ``zero_grad`` does after the first forward
            pass of a window), counted apart (``ReplayedStep.window_first``), then a later one, whose backward adds to
            the gradients the first left, and the optimizer step, counted as the step (``ReplayedStep.phases``, its
            timeline and FLOPs). Every later micro-batch of a window holds what the second holds (the same forward
            pass, the same gradients alive, the same accumulation) and only the window's last adds the optimizer
            step: so the two and the step give the window's highest figure of each phase, at any ``accumulate``.
        autocast_cache: whether a ``*-mixed`` step's autocast caches its cast weights, as the run's precision plugin
            has it: off under a Trainer's ``MixedPrecision`` (``cache_enabled=False``), on under Fabric's, FSDP's and
            a plain loop's ``torch.autocast`` (torch's default). With the cache on, a cast weight is held until the
            training step returns and shared between the calls of a module used twice.
        fabric_forward: the step's precision applies to the module's forward only, its floating inputs and outputs
            converted, as Fabric's ``_FabricModule`` runs it (the step is Fabric's); else to the whole step.
        batch_values: the values of ``batch``'s small CPU tensors as its step started, by the tensor's ``id``
            (:func:`~lightning_vram.prediction.replay.known_values.taken_values`): the replay's known values, where
            the step has since changed its batch in place. ``None``: the batch's values now.
        for_cuda: the step is predicted for a CUDA device, though replayed on another (the CPU, where torch is a
            CPU-only build): its optimizers take the path they take on CUDA (foreach where torch picks it). Where
            torch has no CUDA device, a replay for CUDA (this, or one on fake CUDA tensors) runs CUDA's dropout and
            attention kernels (:mod:`~lightning_vram.prediction.replay.cuda_kernels`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] | None,
        batch: Any,
        *,
        precision: str = "32-true",
        device: torch.device | None = None,
        placement: torch.device | None = None,
        step_function: StepFunction = lightning_training_step,
        warm_up: bool = False,
        shape: tuple[int, ...] | None = None,
        budget_seconds: float | None = None,
        calibration: Attribution | None = None,
        released_late: Callable[[], Mapping[Phase, int]] = dict,
        gradients_at_forward: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
        allocations: Callable[[], AllocationListener] | None = None,
        compute_capability: tuple[int, int] | None = None,
        allocator: AllocatorSettings | None = None,
        measured: Mapping[Phase, PhasePeak] | None = None,
        strategy: StrategyBuffers | None = None,
        shard: Callable[[nn.Module], None] | None = None,
        accumulate: int = 1,
        autocast_cache: bool = False,
        fabric_forward: bool = False,
        batch_values: TakenValues | None = None,
        for_cuda: bool = False,
    ) -> None:
        self.module = module
        self.optimizers = None if optimizers is None else list(optimizers)
        self.configured_optimizer: OptimizerShape | None = None
        """Without ``optimizers``: the first optimizer the module's ``configure_optimizers`` built on a replay's copy
        of it (its class, settings and groups' sizes), once a replay ran."""
        self.batch = batch
        self.batch_values = batch_values
        self.precision = precision
        self.autocast_cache = autocast_cache
        self.fabric_forward = fabric_forward
        self.device = device or placement or module_device(module)
        """The device whose memory is counted."""
        self.for_cuda = for_cuda
        self.placement = placement
        self.step_function = step_function
        self.warm_up = warm_up
        self.shape = shape
        self.budget_seconds = budget_seconds
        self.calibration = calibration
        self.released_late = released_late
        if gradients_at_forward is None:
            forward = calibration.phases.get(Phase.FORWARD) if calibration is not None else None
            gradients_at_forward = forward is None or forward.gradients > 0
        self.gradients_at_forward = gradients_at_forward
        self.clock = clock
        self.started = clock()
        """When the budget started, on :attr:`clock` (seconds)."""
        self.allocations = allocations
        self.compute_capability = compute_capability
        settings = allocator if allocator is not None or self.device.type != "cuda" else run_settings()
        self.allocator = settings if isinstance(settings, AllocatorSettings) else None
        """The allocator settings each replay simulates the reserved memory with (``None``: none simulated)."""
        self._allocator_notes = (settings,) if isinstance(settings, str) else ()
        self._scope: _Scope | str | None = None
        self.measured = measured
        self.strategy = strategy
        self.shard = shard
        self.accumulate = accumulate
        self.carried: Calibration | None = None
        """The sampled step measured beside the baseline (set by :meth:`simulate`): every later replay adds its
        unseen bytes per phase (see :attr:`unseen_bytes`)."""
        self._sequence: ReservedPeaks | None = None  # the baseline's allocation sequence, kept for what-ifs
        self._calls: dict[str, tuple[Call, ...]] | None = None
        """What each module received and returned per call in the replay without a change (by path): a
        checkpointing plan's units must be called alike (:func:`~.unit_calls.changed_unit`)."""
        self._read_later: frozenset[str] | None = None
        """The out-of-place activations whose input the replay without a change read again after they returned
        (:class:`~.inplace_reads.LaterReads`): made inplace, they would change what the model computes."""

    @property
    def unseen_bytes(self) -> dict[Phase, int]:
        """Per phase, the allocated bytes the sampled step held beyond the replay (never negative); empty before one.

        Carried into every later replay's peaks. The allocation sequence does not hold them: a simulation of the
        allocator at a capacity adds them itself.
        """
        return self.carried.unseen_bytes if self.carried is not None else {}

    def reserved_with(self, settings: AllocatorSettings, steps_before: int | None = None) -> dict[Phase, int] | None:
        """The baseline's allocation sequence through the allocator model with ``settings``: reserved peaks, bytes.

        Per phase, the replay's own (nothing carried); ``None`` before a baseline replayed with a model.
        ``steps_before``: as the run's step of that index holds them (:meth:`ReservedPeaks.finish`).
        """
        return self._sequence.finish(settings, steps_before) if self._sequence is not None else None

    @property
    def cuda_kernels(self) -> bool:
        """Whether replays run CUDA's dropout and attention kernels: for CUDA, where torch has no CUDA device."""
        return (self.for_cuda or self.device.type == "cuda") and not torch.cuda.is_available()

    @property
    def device_type(self) -> str:
        """The counted device's type (``"cuda"``, ``"cpu"``)."""
        return self.device.type

    def seconds_left(self) -> float | None:
        """Host seconds left of the budget (negative once past it); ``None`` without a budget."""
        if self.budget_seconds is None:
            return None
        return self.started + self.budget_seconds - self.clock()

    def out_of_time(self) -> bool:
        """Whether the budget has run out."""
        left = self.seconds_left()
        return left is not None and left <= 0

    def baseline(self) -> ReplayedStep | ReplaySkipped:
        """The step as it is."""
        return self.replay(None)

    def batch_size(self, size: int) -> ReplayedStep | ReplaySkipped:
        """The step with a batch of ``size`` samples."""
        return self.replay(BatchSizeChange(size))

    def simulate(self, changes: Sequence[StepChange] = (), tolerance: float = BASELINE_TOLERANCE) -> Simulation:
        """The baseline checked against the calibration, then each change.

        See :func:`~lightning_vram.prediction.replay.simulation.simulate`.
        """
        return simulate(self, changes, tolerance)

    def fit_table(
        self,
        context_bytes: int,
        gpus: Sequence[tuple[str, int]] = COMMON_GPUS,
        known_steps: Mapping[int, ReplayedStep] | None = None,
        unseen_bytes: Mapping[Phase, int] | None = None,
    ) -> FitSearch:
        """The largest batch per GPU (see :func:`~lightning_vram.prediction.replay.fit_table.replayed_fit_table`).

        ``unseen_bytes``: per phase, bytes the replay cannot see, held in the simulated allocator; default: what
        this round's calibration carries (:attr:`unseen_bytes`).
        """
        unseen = self.unseen_bytes if unseen_bytes is None else unseen_bytes
        return replayed_fit_table(
            self, context_bytes=context_bytes, gpus=gpus, known_steps=known_steps, unseen_bytes=unseen or None
        )

    def sharing_walk(self) -> Predictor:
        """A shallow copy of this predictor in the same round, sharing its walk of the user's code (made now, once).

        For a strategy's replays of the same step (:mod:`~lightning_vram.prediction.strategies`): the caller sets
        on the copy what differs (``strategy``, ``shard``, ``step_function`` wrapping this one's, ``warm_up``).
        """
        self._refusal()
        return copy.copy(self)

    def _refusal(self) -> _Scope | str:
        """What the replays may reach, walked on the first replay; or why no replay may run (decided once)."""
        if self._scope is None:
            self._scope = self._walk()
        return self._scope

    def _walk(self) -> _Scope | str:
        module = self.module
        compiled = compiled_module_names(module)
        if compiled:  # predict() on a compiled model: the session's own replays stop before this
            wrapper = module.get_submodule(compiled[0])
            return compiled_refusal(f"{compiled_callable_name(wrapper)} ({compiled[0] or 'the model'})")
        refusal = scripted_refusal(module) or sparse_refusal(module)
        if refusal is not None:
            return refusal
        shared = [*shared_arrays(module), *shared_arrays(self.batch)]
        inside = inside_ids(module)
        reach = reach_of(code_roots(module, self.step_function, self.optimizers or (), self.batch), inside)
        reach.objects.extend(hook_registries())  # a global hook the step registers is registered again by the replay
        refusal = refusal_of(reach)
        if refusal is not None:
            return refusal
        reach.arrays += shared
        return _Scope(reach, inside, shared)

    def _outside(self, effects: OutsideEffects | None) -> str | None:
        """Why the replay is refused where the user's code reached outside the process; ``None`` where it did not.

        The step does it in every replay (a file written): the predictor runs none again (:attr:`_scope`).
        """
        reason = effects.reason if effects is not None else None
        if reason is not None:
            self._scope = reason
        return reason

    def _strategy_buffers(self) -> list[torch.Tensor]:
        """The strategy's buffers as (fake) bytes on the counted device; call under the replay's fake mode."""
        buffers = self.strategy.buffers if self.strategy is not None else ()
        return [torch.empty(size, dtype=torch.uint8, device=self.device) for size in buffers]

    def _prepare(self, run: StepRun) -> Callable[[nn.Module], None]:
        """What changes a replay's fake module: the step's own changes, then :attr:`shard`."""
        shard = self.shard
        if shard is None:
            return run.prepare_module

        def prepare(module: nn.Module) -> None:
            run.prepare_module(module)
            shard(module)

        return prepare

    def _listener(self) -> tuple[AllocationListener | None, ReservedPeaks | None]:
        """A replay's allocation listener: the caller's, else the allocator model (its reserved peaks), else none."""
        if self.allocations is not None:
            return self.allocations(), None
        if self.allocator is not None:
            reserved = ReservedPeaks(self.allocator)
            return reserved, reserved
        return None, None

    def replay(self, change: StepChange | None = None, count_flops: bool = False) -> ReplayedStep | ReplaySkipped:
        """Replay one training step with ``change`` (``None``: the baseline) on fake tensors and count it.

        The user's code runs on the replay's copies; what it can reach beyond them is saved and put back
        (:mod:`~lightning_vram.prediction.containment`). A step whose code reaches the trained model itself is not
        replayed. With ``count_flops``, the step's FLOPs are counted too (``ReplayedStep.flops``, from the ops the live
        count sees: no mode of its own, so none of its memory figures changes), with each op's bytes moved, phase and
        recomputation (``ReplayedStep.work``).
        """
        left = self.seconds_left()
        deadline = None if left is None else time.perf_counter() + left
        started = time.perf_counter()
        try:
            plan = precision_plan(change.precision if isinstance(change, PrecisionChange) else self.precision)
            # Under the user's own autocast the cache is theirs: the replay's casts stay out of it.
            plan = replace(
                plan,
                autocast_cache=self.autocast_cache and not autocast_spans_the_replay(),
                module_scope=self.fabric_forward,
            )
        except ValueError as error:
            return ReplaySkipped(str(error))
        scope = self._refusal()
        if isinstance(scope, str):
            return ReplaySkipped(scope)
        unchecked = audit_refusal()  # the hook that stops the step's file writes, added at the process's first replay
        if unchecked is not None:
            return ReplaySkipped(unchecked)
        if profiler_recording():
            return ReplaySkipped(PROFILER_SKIP)
        if isinstance(change, CheckpointChange | InplaceChange) and self._calls is None:
            # what the plan's units must receive and return, call by call; which inputs are read again later
            Predictor.replay(self, None)
        if isinstance(change, InplaceChange) and self._read_later is not None:
            read_later = read_later_reason(change.modules, self._read_later)
            if read_later is not None:
                return ReplaySkipped(f"the change would train another model: {read_later}")
        # The user's code runs in a copy of the context: a ContextVar it sets (one with no value before included,
        # which no ContextVar method can unset) is the replay's own, and the training context never sees it.
        return contextvars.copy_context().run(
            self._replay_in_context, change, plan, scope, deadline, started, count_flops
        )

    def _replay_in_context(
        self,
        change: StepChange | None,
        plan: PrecisionPlan,
        scope: _Scope,
        deadline: float | None,
        started: float,
        count_flops: bool,
    ) -> ReplayedStep | ReplaySkipped:
        """:meth:`replay`'s body, once the precision and the walk allow it (``deadline``, ``started``: perf seconds)."""
        anomaly_detection = torch.is_anomaly_enabled()  # off while the replay runs (isolated())
        run = StepRun(self.device, plan, change, self.step_function, self.placement, self.shape, self.accumulate)
        counter: ReplayCounter | None = None
        first: ReplayCounter | None = None
        first_counts: dict[Phase, Breakdown] | None = None
        first_timeline: TimelineRecorder | None = None
        first_peaks: dict[Phase, int] = {}
        frames = CheckpointFrames()
        run.checkpoint_frames = frames.recorded
        recorder: CallRecorder | None = None
        reads: LaterReads | None = None
        effects: OutsideEffects | None = None
        twin: Twin | None = None
        try:
            # configure_optimizers is user code too; from the module's copy on, what the user's code writes to files,
            # the processes it starts and the connections it opens are refused as they happen
            with (
                outside_autocast(),
                isolated(),
                contained(scope.reach) as containment,
                frames,
                refusing_outside_effects() as effects,
            ):
                mode = FakeTensorMode(allow_non_fake_inputs=True)
                register(mode)
                twin = make_twin(
                    self.module,
                    self.optimizers,
                    self.batch,
                    mode,
                    self._prepare(run),
                    {id(a): a for a in scope.shared},
                    "cuda" if self.for_cuda else None,
                )
                if self.optimizers is None and self.configured_optimizer is None and twin.optimizers:
                    self.configured_optimizer = OptimizerShape.of(twin.optimizers[0])
                held = held_by(twin.module, scope.inside, own=(mode,), after=scope.reach)
                refusal = closure_refusal(twin.optimizers) or refusal_of(held)
                if refusal is not None:
                    raise RefusedError(refusal)
                values = KnownValues()
                values.know(twin.batch_values, self.batch_values)
                recorder = CallRecorder(twin.module) if change is None else None
                reads = LaterReads(twin.module) if change is None else None
                kernels = CudaKernels() if self.cuda_kernels else None
                with (
                    contained(held) as held_containment,
                    mode,
                    MixedNormDtypes(),
                    kernels if kernels is not None else nullcontext(),
                    without_collectives(),
                    Deadline(deadline),
                    values,
                    real_branches(values),
                    recorder or nullcontext(),
                    reads or nullcontext(),
                ):
                    fake_batch = run.prepare_batch(twin.batch)
                    if self.warm_up:
                        run.run_step(twin, fake_batch, None, None)
                    if isinstance(change, FreeGradientsChange) or not self.gradients_at_forward:
                        for parameter in twin.module.parameters():
                            parameter.grad = None
                    allocations, reserved = self._listener()
                    live = LiveMemory(self.device, allocations)
                    gradients, optimizer_state = gradient_blocks(twin), optimizer_state_blocks(twin)
                    live.track(state_tensors(twin))
                    held_by_strategy = self._strategy_buffers()
                    live.track(held_by_strategy)
                    live.track([*iter_tensors(fake_batch), *twin.batch_tensors])
                    counter = ReplayCounter(
                        twin.module, twin.optimizers, self.device, live.producer, LOSS_OPS, LOSS_READERS
                    )
                    live.add_listener(counter.on_output)
                    live.add_op_listener(counter.on_op)
                    timeline = TimelineRecorder(
                        lambda: live.live_bytes, counter.live_parts, lambda: counter.current_module
                    )
                    workspaces = LibraryWorkspaces(
                        allocations,
                        self.compute_capability,
                        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                        os.environ.get("CUBLASLT_WORKSPACE_SIZE"),
                    )
                    if self.device.type == "cuda":
                        live.add_sampler(workspaces)
                    if reserved is not None:
                        live.add_sampler(reserved)
                    probe = WorkspaceProbe()
                    flops = (
                        StepFlops(lambda: counter is not None and counter.current_module is not None)
                        if count_flops
                        else None
                    )
                    if reads is not None:
                        live.add_op_listener(reads.on_op)
                    with probe, live:
                        if self.accumulate > 1:  # the window's first micro-batch, counted on its own
                            first = ReplayCounter(
                                twin.module, twin.optimizers, self.device, live.producer, LOSS_OPS, LOSS_READERS
                            )
                            live.add_listener(first.on_output)
                            live.add_op_listener(first.on_op)
                            first_timeline = TimelineRecorder(
                                lambda: live.live_bytes, first.live_parts, lambda: first.current_module
                            )
                            live.add_sampler(first_timeline)
                            run.run_micro_batch(twin, fake_batch, first, live)
                            live.remove_sampler(first_timeline)
                            first_counts, first_peaks = first.finish()[0], live.restart()
                        live.add_sampler(timeline)
                        if flops is not None:
                            live.add_op_listener(flops.count)
                            live.add_sampler(flops)
                        run.run_step(twin, fake_batch, counter, live, zero_grad=self.accumulate == 1)
                    if reserved is not None:  # for the steps before it, which start without these and make them
                        ended = zip(gradients, gradient_blocks(twin), strict=False)
                        carried = {block: after for block, after in ended if block is not None and after is not None}
                        made_state = not optimizer_state and bool(optimizer_state_blocks(twin))
                        reserved.starts_with(carried, optimizer_state, first=made_state)
                    changed = changed_unit(self._calls or {}, checkpointed_calls(twin.module))
                    if changed is not None and self._calls is not None:
                        raise RefusedError(f"the checkpointing plan changes what the model computes: {changed}")
                    phases, modules = counter.finish()
                    reserved_peaks = reserved.finish() if reserved is not None else {}
                    sequence = reserved.sequence() if reserved is not None else None
        except ContainmentError:
            raise
        except (RefusedError, HookedCopyError) as refused:
            return ReplaySkipped(self._outside(effects) or str(refused), time.perf_counter() - started)
        except (Exception, OutsideEffectsRepeated) as error:  # noqa: BLE001 -- the user's step on fake tensors
            # any failure is a reason to skip; a refused file write first: the step may have caught the refusal and
            # failed further on, or tried it again (OutsideEffectsRepeated)
            reason = self._outside(effects) or skip_reason(error, run.phase)  # before the frames are cleared
            release_frames(error)
            frames.release()
            drain_autograd()
            return ReplaySkipped(reason, time.perf_counter() - started)
        finally:
            for opened in (counter, first):
                if opened is not None:
                    opened.close()
            if twin is not None:
                release_gradients(twin)
                release_plan(twin.module)
        refused_effect = self._outside(effects)
        if refused_effect is not None:  # the step caught the refusal and went on
            return ReplaySkipped(refused_effect, time.perf_counter() - started)
        if change is None and reserved is not None:
            self._sequence = reserved
        if recorder is not None:
            self._calls = recorder.by_name()
        if reads is not None:
            self._read_later = reads.names()
        step = self.calibration.step if self.calibration is not None else 0
        # The allocator counts the library workspaces among its allocated bytes: a steady step holds every one from
        # its start (earlier steps took them), in each phase.
        workspace_bytes = workspaces.held_bytes if self.device.type == "cuda" else 0
        replayed = ReplayedStep(
            device_type=self.device.type,
            precision=plan.name,
            batch_size=batch_size_of(fake_batch),
            phases={
                phase: PhasePeak(
                    step=step,
                    phase=phase,
                    peak_bytes=live.phase_peaks[phase] + workspace_bytes,
                    reserved_bytes=reserved_peaks.get(phase),
                    breakdown=breakdown.with_measured_peak(live.phase_peaks[phase] + workspace_bytes),
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
                *workspaces.notes,
                *(kernels.notes if kernels is not None else ()),
                *(flops.notes if flops is not None else ()),
                *self._allocator_notes,
                *((SPANNING_AUTOCAST_NOTE,) if self.autocast_cache and not plan.autocast_cache else ()),
                *((ANOMALY_NOTE,) if anomaly_detection else ()),
                *(
                    f"the replayed code changed {place}; put back as it was"
                    for place in (*containment.restored, *held_containment.restored)
                ),
            ),
            timeline=timeline.finish(),
            flops=flops.get_total_flops() if flops is not None else None,
            work=flops.work() if flops is not None else None,
            allocations=sequence,
            allocator=None if sequence is None or self.allocator is None else self.allocator.conf(),
            strategy=self.strategy,
            window_first=None
            if first_counts is None
            else {
                phase: PhasePeak(step, phase, first_peaks[phase], None, counted.with_measured_peak(first_peaks[phase]))
                for phase, counted in first_counts.items()
            },
            window_first_timeline=None if first_timeline is None else first_timeline.finish(),
        )
        return carry(replayed, self.carried, batch_size_of(self.batch)) if self.carried is not None else replayed
