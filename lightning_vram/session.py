"""``VramSession``: the Lightning-free measuring core. The Lightning callback, Fabric loops and plain loops drive it.

A session's calls mirror the phase boundaries of a training step::

    session = VramSession(log_dir="runs/plain")
    session.start(model, optimizers=[optimizer])
    for batch in loader:
        session.batch_start(batch)
        loss = loss_fn(model(batch))
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step(); optimizer.zero_grad()
        scalars = session.batch_end()          # the vram/... scalars at the end of each log interval, else {}
    report = session.finish()                  # writes vram_report.json/.md/.html into log_dir

Every call is guarded: an error in the monitor's own code warns once, switches that part off and is listed in the
report's ``not_measured``; training goes on.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_vram._guard import Guard, Part
from lightning_vram.advice.oom import diagnose
from lightning_vram.advice.preflight import candidate_changes, preflight
from lightning_vram.advice.replay.step import StepFunction, lightning_training_step
from lightning_vram.advice.report import build_report
from lightning_vram.advice.rules import advise
from lightning_vram.advice.trials import try_changes
from lightning_vram.codec import FormatError, simulation_from_dict, simulation_to_dict
from lightning_vram.config import MonitorConfig, check_start, start_device
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.measure import history
from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.code_roots import code_roots, inside_ids
from lightning_vram.measure.compiled import compiled_module_names
from lightning_vram.measure.probes import BlindProbe, Probe, probe_for
from lightning_vram.measure.reach import reach_of
from lightning_vram.measure.setup import training_setup
from lightning_vram.measure.storages import model_state_bytes
from lightning_vram.measure.tensors import batch_size_of
from lightning_vram.measure.timing import Clock, StepTimer
from lightning_vram.measure.tracker import MemoryTracker
from lightning_vram.measure.user_code import is_user_file
from lightning_vram.records import (
    AllocatorReading,
    Breakdown,
    DeviceInfo,
    EvaluationPeak,
    NotMeasured,
    OomDiagnosis,
    Phase,
    PreflightVerdict,
    RankSummary,
    Report,
    RunSummary,
    Simulation,
    TrainingSetup,
)
from lightning_vram.render.console import print_summary
from lightning_vram.render.files import (
    SNAPSHOT_STEM,
    FilesNotWritten,
    Location,
    as_location,
    report_stem,
    write_diagnosis,
    write_report_files,
)
from lightning_vram.render.scalars import interval_scalars, reduce_over_ranks, scalar_vector
from lightning_vram.render.tensorboard import TensorBoardWriter, write_advice, write_figures, write_layout
from lightning_vram.render.text import evaluation_text, oom_headline, preflight_warning

STATE_VERSION = 2
"""Version of :meth:`VramSession.state_dict`'s layout; a checkpoint with another one starts the aggregates fresh."""
DEFAULT_LOG_EVERY_N_STEPS = 50
"""Steps between interval scalars when neither the session nor a Trainer sets it (Lightning's default)."""
NO_SCALARS: Mapping[str, float] = MappingProxyType({})
Gather = Callable[[list[float]], list[list[float]]]
"""Every rank's list of numbers (the same length on each), rank by rank: one collective."""
Optimizers = Sequence[torch.optim.Optimizer] | Callable[[], Sequence[torch.optim.Optimizer]]
T = TypeVar("T")

_ATTRIBUTING: weakref.WeakSet[VramSession] = weakref.WeakSet()
"""Sessions whose attributor is counting a step now (one at a time per process); a session dropped mid-step leaves."""

NO_STEP = NotMeasured(
    "training steps", "no training step ran (max_steps=0, max_epochs=0, limit_train_batches=0 or an empty loader)"
)


class VramSession:
    """Where device memory goes during training, phase by phase, for any training loop.

    Every step, the allocator's peak is read at the phase boundaries from host-side counters, without synchronising
    the device. On sampled steps the tensors are counted one by one: parameters, gradients, optimizer state and the
    activations each module saves for backward. :meth:`finish` builds the :class:`~lightning_vram.records.Report`
    and writes ``vram_report.json``, ``.md`` and ``.html`` into ``log_dir``.

    Args:
        log_dir: directory for the report files: a local path, or a URL fsspec can write to (``s3://...``, as
            Lightning's loggers take it); ``None`` writes none (the report is still returned).
        log_every_n_steps: steps between interval scalars (returned by :meth:`batch_end`); ``None`` is 50, or the
            Trainer's setting under :class:`~lightning_vram.VramMonitor`.
        attribution_start_step, attribution_every_n_steps, reset_peak_stats, utilization_interval_seconds,
        top_modules, recent_steps, console_summary, record_history, history_max_entries, replay_budget_seconds,
            preflight, probe, clock: as for :class:`~lightning_vram.VramMonitor`.
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        log_every_n_steps: int | None = None,
        attribution_start_step: int = 2,
        attribution_every_n_steps: int | None = 100,
        reset_peak_stats: bool = True,
        utilization_interval_seconds: float = 0.5,
        top_modules: int = 10,
        recent_steps: int = 512,
        console_summary: bool = True,
        record_history: bool = False,
        history_max_entries: int = 100_000,
        replay_budget_seconds: float = 30.0,
        preflight: bool = True,
        probe: Probe | None = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.config = MonitorConfig(
            log_every_n_steps=log_every_n_steps,
            attribution_start_step=attribution_start_step,
            attribution_every_n_steps=attribution_every_n_steps,
            reset_peak_stats=reset_peak_stats,
            utilization_interval_seconds=utilization_interval_seconds,
            top_modules=top_modules,
            recent_steps=recent_steps,
            console_summary=console_summary,
            record_history=record_history,
            history_max_entries=history_max_entries,
            replay_budget_seconds=replay_budget_seconds,
            preflight=preflight,
        )
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir must be a path (str or os.PathLike) or None, got {type(log_dir).__name__}")
        if log_dir is not None and not os.fspath(log_dir):
            raise ValueError("log_dir must be a directory path or None, got an empty path ''")
        if isinstance(probe, type):
            raise TypeError(
                f"probe must be a probe such as ScriptedProbe([...]), got the class {probe.__name__}: create one"
            )
        if probe is not None and not isinstance(probe, Probe):
            raise TypeError(f"probe must implement lightning_vram.measure.probes.Probe, got {type(probe).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        self._clock = clock
        self.log_dir: Location | None = as_location(log_dir) if log_dir is not None else None
        """Where :meth:`finish` writes the report files: a ``Path``, a remote URL as a string, or ``None`` for none."""
        self._probe_override = probe
        self.report: Report | None = None
        """The report of the last run, set by :meth:`finish` (also after :meth:`fail`)."""
        self.report_path: Location | None = None
        """Where ``vram_report.json`` was written (rank zero, with a ``log_dir``): a ``Path`` on a local disk, the URL
        as a string on a remote filesystem (a ``Path`` would collapse its ``//``); ``None`` when it was not written."""
        self.oom_diagnosis: OomDiagnosis | None = None
        """This rank's diagnosis when the run ended with a CUDA out-of-memory error."""
        self.preflight_verdict: PreflightVerdict | None = None
        """The first step replayed against the device's free memory before it ran (CUDA, ``preflight=True``)."""
        self._pending_state: Any = None
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._guard = Guard()
        self._probe: Probe | None = None
        self._device = torch.device("cpu")
        self._device_info: DeviceInfo | None = None
        self._model: nn.Module | None = None
        self._optimizers: Optimizers = ()
        self._setup: Callable[[], TrainingSetup] | None = None
        self._rank = 0
        self._world_size = 1
        self._gather: Gather | None = None
        self._barrier: Callable[[], None] | None = None
        self._writers: Sequence[TensorBoardWriter] = ()
        self._log_every: int | None = None
        self._tracker = MemoryTracker(self.config.recent_steps, self.config.reset_peak_stats)
        self._timer = StepTimer(self.config.recent_steps, self._clock)
        self._attributor: StepAttributor | None = None
        self._phase: Phase | None = None
        self._cuda_context_bytes: int | None = None
        self._evaluating: str | None = None
        self._standalone_evaluation = False
        self._compiled_note: NotMeasured | None = None
        self._attribution_notes: dict[str, NotMeasured] = {}  # what sampled steps skipped, shared with attributors
        self._hook_apis: tuple[str, ...] | None = None  # saved-tensor-hook APIs the training code uses, once known
        self._history_note: NotMeasured | None = None
        self._recording_history = False
        self._finished = False
        self._step_function: StepFunction | None = None
        self._simulation: Simulation | None = None
        self._sampled_batch: Any = None
        self._preflight_pending = True

    # ------------------------------------------------------------------------------------------------ set-up

    def start(
        self,
        model: nn.Module,
        optimizers: Optimizers = (),
        *,
        dataloader: Any = None,
        precision: str = "32-true",
        device: torch.device | None = None,
        setup: Callable[[], TrainingSetup] | None = None,
        rank: int = 0,
        world_size: int = 1,
        gather: Gather | None = None,
        barrier: Callable[[], None] | None = None,
        tensorboard: Sequence[TensorBoardWriter] = (),
        default_log_every_n_steps: int | None = DEFAULT_LOG_EVERY_N_STEPS,
        step_function: StepFunction | None = None,
    ) -> None:
        """Start measuring a run of ``model`` (on its device) with ``optimizers``.

        Args:
            model: the module trained; its parameters' device is the one measured unless ``device`` is given.
            optimizers: its optimizers, or a callable returning them (read again on each sampled step).
            dataloader: the training DataLoader, so advice can read ``num_workers`` and ``pin_memory``.
            precision: the precision trained in, as Lightning names it (``"32-true"``, ``"bf16-mixed"``...).
            device: the device to measure, when the model's first parameter is not on it (a ``torch.device`` or a
                device string such as ``"cuda:1"``).
            setup: a callable returning the training set-up for advice (the callback reads its Trainer); default:
                one read from ``model``, ``optimizers``, ``dataloader`` and ``precision``.
            rank: this process's global rank.
            world_size: the number of processes training together.
            gather: every rank's numbers (one collective); needed when ``world_size > 1``.
            barrier: waits until every rank calls it (one collective): with ``world_size > 1``, :meth:`finish`
                holds the other ranks there until rank zero has written the files. A collective that fails (a rank
                gone) warns once; the monitor runs no other one, and its report covers this rank.
            tensorboard: SummaryWriters that get the custom-scalars layout, the advice text and the figures.
            default_log_every_n_steps: the interval when ``log_every_n_steps`` was not given; ``None`` logs none.
            step_function: ``(module, batch) -> loss``: the forward pass and loss of one step, so that advice can be
                replayed on it under fake tensors; a module with a ``training_step`` (a LightningModule) needs none.

        Raises:
            TypeError, ValueError: an argument is not what it must be (the message names it); nothing starts.
        """
        check_start(
            model,
            optimizers,
            precision=precision,
            setup=setup,
            rank=rank,
            world_size=world_size,
            gather=gather,
            barrier=barrier,
            tensorboard=tensorboard,
            default_log_every_n_steps=default_log_every_n_steps,
            step_function=step_function,
        )
        device = start_device(device)
        self.close()  # a run left unfinished (its loop died without fail()) lets go of its hooks and probe first
        self._reset_run_state()
        self.report = self.oom_diagnosis = self.preflight_verdict = None
        self.report_path = None
        self._model = model
        self._optimizers = optimizers
        self._device = device if device is not None else _model_device(model)
        self._rank, self._world_size, self._gather, self._barrier = rank, world_size, gather, barrier
        self._writers = tensorboard
        self._setup = setup or (
            lambda: training_setup(model, self._current_optimizers(), dataloaders=dataloader, precision=precision)
        )
        self._log_every = self.config.log_every_n_steps or default_log_every_n_steps
        if step_function is None and callable(getattr(model, "training_step", None)):
            step_function = lightning_training_step
        self._step_function = step_function
        self._open_probe()
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        for writer in self._writers:
            self._guarded(Part.TENSORBOARD, write_layout, writer)
        if self.config.record_history:
            self._start_history()

    def _open_probe(self) -> None:
        probe = self._probe_override or probe_for(self._device, self.config.utilization_interval_seconds)
        try:
            self._device_info = probe.open(self._device)
        except Exception as error:  # noqa: BLE001 -- the guard: the run goes on, read by a probe that reads nothing
            self._guard.fail(Part.PROBE, error)
            probe = BlindProbe()
            self._device_info = probe.open(self._device)
        self._probe = probe
        if self._device_info.type != "cuda":
            warnings.warn(
                f"VramMonitor: the model trains on {self._device}, not a CUDA GPU: allocator peaks, 'other' memory"
                " and GPU utilization are not measured; tensors are still counted.",
                VramMonitorWarning,
                stacklevel=4,
            )

    def _start_history(self) -> None:
        reason = history.unavailable_reason() if self._device.type == "cuda" else "training does not run on CUDA"
        if reason is None and self._guarded(Part.HISTORY, history.start_recording, self.config.history_max_entries):
            self._recording_history = True
            return
        if reason is not None:
            self._history_note = NotMeasured("allocator history (record_history=True)", reason)
            warnings.warn(f"VramMonitor: record_history is off: {reason}.", VramMonitorWarning, stacklevel=4)

    def _current_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizers = self._optimizers
        return list(optimizers() if callable(optimizers) else optimizers)

    def _guarded(self, part: Part, function: Callable[..., Any], *args: Any) -> bool:
        """Run ``function(*args)`` as ``part``; ``False`` when the part is off or fails now (it warns once)."""
        if not self._guard.enabled(part):
            return False
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 -- the guard: the monitor's own failure must not stop training
            self._guard.fail(part, error)
            return False
        return True

    # ------------------------------------------------------------------------------------------------ hot path

    def _read_allocator(self) -> AllocatorReading | None:
        probe = self._probe
        if probe is None or not self._guard.enabled(Part.ALLOCATOR):
            return None
        try:
            return probe.read_allocator(self.config.reset_peak_stats)
        except Exception as error:  # noqa: BLE001 -- the guard
            self._guard.fail(Part.ALLOCATOR, error)
            return None

    def batch_start(self, batch: Any = None) -> None:
        """A training step starts (before its forward pass). ``batch`` gives the batch size on sampled steps."""
        if self._probe is None or self._finished:
            return
        if self._attributor is not None:  # the last sampled step never ended (its batch stopped at its start hook)
            self._close_attributor()
            self._sampled_batch = None
        guard = self._guard
        if guard.enabled(Part.TIMING):
            try:
                self._timer.batch_started()
            except Exception as error:  # noqa: BLE001 -- the guard
                guard.fail(Part.TIMING, error)
        reading = self._read_allocator()
        if guard.enabled(Part.TRACKER):
            try:
                self._tracker.start_step(reading)
            except Exception as error:  # noqa: BLE001 -- the guard
                guard.fail(Part.TRACKER, error)
        self._phase = Phase.FORWARD
        if self._preflight_pending:
            self._preflight_pending = False
            self._preflight(batch, reading)
        if self.config.is_sampled(self._tracker.steps) and guard.enabled(Part.ATTRIBUTION):
            self._start_attribution(batch)
            if self._simulation is None:
                self._sampled_batch = batch  # replayed at the step's end (its shapes and dtypes only)

    def _start_attribution(self, batch: Any) -> None:
        model = self._model
        if model is None or self._stands_aside(model):
            return
        if any(other is not self for other in _ATTRIBUTING):  # saved-tensor hooks do not nest
            self._attribution_notes.setdefault(
                "busy",
                NotMeasured(
                    "tensor-by-tensor attribution on some sampled steps",
                    "another monitor in this process was counting the same step (saved-tensor hooks do not nest);"
                    " those steps were not counted here",
                ),
            )
            return
        attributor = None
        try:
            attributor = StepAttributor(
                self._tracker.steps, model, self._current_optimizers(), self._device, self._attribution_notes
            )
            attributor.begin_forward(batch)
        except Exception as error:  # noqa: BLE001 -- the guard (saved-tensor hooks refused, a model it cannot read)
            if attributor is not None:
                attributor.close()
            self._guard.fail(Part.ATTRIBUTION, error)
            return
        self._attributor = attributor
        _ATTRIBUTING.add(self)
        if attributor.compiled and self._compiled_note is None:
            self._compiled_note = NotMeasured(
                "per-module activations inside compiled modules",
                f"{', '.join(attributor.compiled)} run(s) as torch.compile graphs: their saved tensors are counted"
                " and charged to the compiled module as a whole",
            )

    def _stands_aside(self, model: nn.Module) -> bool:
        """Whether the training code uses saved-tensor-hook APIs the attribution's hooks would break or miss.

        Decided once per run, before any sampled step, from the code (``torch.func.grad`` and ``vjp`` refuse to run
        under saved-tensor hooks, ``disable_saved_tensors_hooks`` refuses them, the code's own hooks hide what they
        pack); the report says so.
        """
        if self._hook_apis is None:
            roots = code_roots(model, self._step_function, self._current_optimizers())
            self._hook_apis = tuple(sorted(reach_of(roots, inside_ids(model)).hook_apis))
            if self._hook_apis:
                self._attribution_notes["hook-apis"] = NotMeasured(
                    "tensor-by-tensor attribution (parts, activations per module)",
                    f"the training code uses {', '.join(self._hook_apis)}, which the monitor's saved-tensor hooks"
                    " would break or not see: sampled steps were not counted tensor by tensor",
                )
        return bool(self._hook_apis)

    def _boundary(self, label: Phase, next_phase: Phase | None) -> None:
        """End the segment since the last boundary as ``label``: one allocator read, folded by the tracker."""
        reading = self._read_allocator()
        guard = self._guard
        if guard.enabled(Part.TRACKER):
            try:
                self._tracker.close_phase(label, reading)
            except Exception as error:  # noqa: BLE001 -- the guard
                guard.fail(Part.TRACKER, error)
        self._phase = next_phase

    def _attribution_call(self, method: Callable[[], Any]) -> Any:
        attributor = self._attributor
        if attributor is None:
            return None
        try:
            if attributor.error is not None:
                raise attributor.error
            return method()
        except Exception as error:  # noqa: BLE001 -- the guard
            self._close_attributor()
            self._guard.fail(Part.ATTRIBUTION, error)
            return None

    def before_backward(self) -> None:
        """A backward pass is about to run: what ran since the last boundary was a forward pass."""
        if self._phase is None:
            return
        self._boundary(Phase.FORWARD, Phase.BACKWARD)
        if self._attributor is not None:
            self._attribution_call(self._attributor.before_backward)

    def before_optimizer_step(self) -> None:
        """An optimizer is about to step: the segment since the last boundary (usually backward) ends."""
        if self._phase is None:
            return
        self._boundary(self._phase, Phase.OPTIMIZER)
        if self._attributor is not None:
            self._attribution_call(self._attributor.before_optimizer_step)

    def batch_end(self) -> Mapping[str, float]:
        """The training step ended. Returns the ``vram/...`` scalars when a log interval ends, else an empty dict.

        With ``world_size > 1`` every rank must call it at the same steps: an interval's end is one gather.
        """
        phase = self._phase
        if phase is None:
            return NO_SCALARS
        self._boundary(phase, None)
        attribution = None
        if self._attributor is not None:
            attribution = self._attribution_call(self._attributor.finish)
            self._close_attributor()  # finish removed its hooks already; this frees the process-wide slot
        guard = self._guard
        if guard.enabled(Part.TRACKER):
            try:
                self._tracker.end_step(attribution)
            except Exception as error:  # noqa: BLE001 -- the guard
                guard.fail(Part.TRACKER, error)
        else:
            self._tracker.count_step()  # peaks are off, the step count still drives sampling and the report
        if attribution is not None and self._sampled_batch is not None:
            self._replay(attribution, self._sampled_batch)
        self._sampled_batch = None
        if guard.enabled(Part.TIMING):
            try:
                self._timer.batch_ended()
            except Exception as error:  # noqa: BLE001 -- the guard
                guard.fail(Part.TIMING, error)
        every = self._log_every
        if every is not None and self._tracker.steps % every == 0:
            return self._interval_scalars()
        return NO_SCALARS

    def _preflight(self, batch: Any, reading: AllocatorReading | None) -> None:
        """Before the first step on a CUDA device: replay it, and warn if it is predicted not to fit."""
        probe, device, model, setup = self._probe, self._device_info, self._model, self._setup
        budget = self.config.replay_budget_seconds
        if not self.config.preflight or budget <= 0 or device is None or device.type != "cuda":
            return
        if probe is None or model is None or setup is None or reading is None or self._step_function is None:
            return
        if compiled_module_names(model):  # replaying compiled graphs on fake tensors would make them recompile
            return
        if not self._guard.enabled(Part.REPLAY):
            return
        try:
            free = probe.free_bytes()
            if free is None:
                return
            training = setup()
            changes = candidate_changes(training.precision, batch_size_of(batch), device.compute_capability)
            verdict = preflight(
                model,
                self._current_optimizers(),
                batch,
                reading=reading,
                free_bytes=free,
                changes=changes,
                precision=training.precision,
                step_function=self._step_function,
                budget_seconds=budget,
            )
        except Exception as error:  # noqa: BLE001 -- the guard
            self._guard.fail(Part.REPLAY, error)
            return
        self.preflight_verdict = verdict if isinstance(verdict, PreflightVerdict) else None
        if isinstance(verdict, PreflightVerdict) and not verdict.fits:
            warning = preflight_warning(verdict, f"{device.name} ({device.type}:{device.index})")
            warnings.warn(warning, VramMonitorWarning, stacklevel=4)

    def _replay(self, attribution: Any, batch: Any) -> None:
        """After the first sampled step past step 0: replay it and every change the rules could advise."""
        model, setup, budget = self._model, self._setup, self.config.replay_budget_seconds
        if model is None or setup is None or budget <= 0 or attribution.step < 1:
            return
        if not self._guard.enabled(Part.REPLAY):
            return
        try:
            self._simulation = try_changes(
                model,
                self._current_optimizers(),
                batch,
                attribution,
                self.summary(),
                setup(),
                device=self._device,
                step_function=self._step_function,
                budget_seconds=budget,
            )
        except Exception as error:  # noqa: BLE001 -- the guard
            self._guard.fail(Part.REPLAY, error)

    @property
    def simulation(self) -> Simulation | None:
        """The replay of the run's sampled step and of each change tried on it (``None`` before it ran)."""
        return self._simulation

    def break_continuity(self) -> None:
        """The time until the next training step is not data wait (an epoch boundary, a validation run)."""
        self._timer.break_continuity()

    # ------------------------------------------------------------------------------------------------ intervals

    def _interval_scalars(self) -> Mapping[str, float]:
        scalars: dict[str, float] = {}
        guard = self._guard
        if guard.enabled(Part.SCALARS):
            try:
                scalars = self._local_scalars()
            except Exception as error:  # noqa: BLE001 -- the guard
                guard.fail(Part.SCALARS, error)
        gather = self._gather
        if self._world_size > 1 and gather is not None:
            # Every rank reaches this at the same step and joins the gather, whatever failed on it: one collective.
            vector = scalar_vector(scalars)
            rows = self._exchange(lambda: gather(vector))
            if rows is not None:
                scalars = reduce_over_ranks(rows)
        return scalars

    def _local_scalars(self) -> dict[str, float]:
        probe = self._probe
        memory, timing = self._tracker.take_interval(), self._timer.take_interval()
        utilization, host_rss = None, None
        if probe is not None and self._guard.enabled(Part.UTILIZATION):
            try:
                utilization, host_rss = probe.take_utilization(), probe.host_rss_bytes()
            except Exception as error:  # noqa: BLE001 -- the guard
                self._guard.fail(Part.UTILIZATION, error)
        if utilization is not None and utilization.process_memory_bytes is not None and memory.reserved_bytes:
            # What NVML sees beyond the allocator's reserve: the CUDA context and library workspaces.
            self._cuda_context_bytes = max(utilization.process_memory_bytes - memory.reserved_bytes, 0)
        return interval_scalars(memory, timing, utilization, host_rss)

    def epoch_end(self, step: int) -> None:
        """Write the advice so far as TensorBoard text (with ``tensorboard`` writers given to :meth:`start`)."""
        if not self._writers or self._probe is None or self._device_info is None:
            return
        if self._guard.enabled(Part.TENSORBOARD):
            try:
                setup = self._setup() if self._setup is not None else None
                advice = advise(self.summary(), setup, self._simulation) if setup is not None else ()
                for writer in self._writers:
                    write_advice(writer, advice, step)
            except Exception as error:  # noqa: BLE001 -- the guard
                self._guard.fail(Part.TENSORBOARD, error)

    # ------------------------------------------------------------------------------------------------ evaluation

    def start_evaluation(self, stage: str, model: nn.Module | None = None) -> None:
        """An evaluation loop (``validation``, ``test`` or ``predict``) starts; outside a run it is measured alone."""
        self._evaluating = stage
        if self._probe is None and model is not None:
            self._device = _model_device(model)
            self._open_probe()
            self._standalone_evaluation = True

    def evaluation_batch_start(self) -> None:
        """An evaluation batch starts."""
        if self._evaluating is not None and self._guard.enabled(Part.TRACKER):
            self._tracker.start_evaluation_batch(self._read_allocator())

    def evaluation_batch_end(self) -> None:
        """The evaluation batch ends: its allocator peak is kept if it is its stage's highest."""
        stage = self._evaluating
        if stage is not None and self._guard.enabled(Part.TRACKER):
            self._tracker.end_evaluation_batch(stage, self._read_allocator())

    def end_evaluation(self) -> EvaluationPeak | None:
        """The evaluation loop ends; returns its stage's peak when it was measured alone (else ``None``)."""
        stage, self._evaluating = self._evaluating, None
        if not self._standalone_evaluation or stage is None:
            return None
        self._standalone_evaluation = False
        self.close()
        return self._tracker.evaluation.get(stage)

    @property
    def evaluation_peaks(self) -> dict[str, EvaluationPeak]:
        """The highest evaluation-batch peak of each stage (validation, test, predict) measured (CUDA)."""
        return dict(self._tracker.evaluation)

    @staticmethod
    def evaluation_line(peak: EvaluationPeak, device: torch.device) -> str:
        """The console line for a standalone evaluation's peak."""
        return f"VRAM: {evaluation_text((peak,))} on {device}"

    # ------------------------------------------------------------------------------------------------ the end

    def summary(self) -> RunSummary:
        """What the run measured so far."""
        tracker, timer, probe = self._tracker, self._timer, self._probe
        device = self._device_info
        if device is None:
            raise RuntimeError("VramSession.summary() needs start() first")
        largest = tracker.largest_activation_attribution
        utilization = None
        if probe is not None and self._guard.enabled(Part.UTILIZATION):
            try:
                utilization = probe.mean_utilization_percent()
            except Exception as error:  # noqa: BLE001 -- the guard
                self._guard.fail(Part.UTILIZATION, error)
        return RunSummary(
            device=device,
            peak=tracker.peak,
            phases=tracker.phase_peaks,
            modules=largest.modules if largest is not None else (),
            batch_size=largest.batch_size if largest is not None else None,
            step_seconds_median=timer.median_step_seconds(),
            data_wait_fraction=timer.data_wait_fraction(),
            recent_data_wait_fraction=timer.recent_data_wait_fraction(),
            timed_steps=timer.timed_steps,
            gpu_utilization_mean=utilization,
            alloc_retries=tracker.alloc_retries,
            cuda_context_bytes=self._cuda_context_bytes,
            recovered_ooms=tracker.recovered_ooms,
            last_step=tracker.last_step,
            steps=tracker.steps,
            recent_peaks=tracker.recent,
            evaluation=tuple(tracker.evaluation.values()),
        )

    def _not_measured(self) -> tuple[NotMeasured, ...]:
        notes: list[NotMeasured] = []
        if self._probe is not None and self._guard.enabled(Part.PROBE):
            try:
                notes += self._probe.unavailable()
            except Exception as error:  # noqa: BLE001 -- the guard
                self._guard.fail(Part.PROBE, error)
        if self._tracker.steps == 0:
            notes.append(NO_STEP)
        notes += [note for note in (self._history_note, self._compiled_note) if note is not None]
        notes += self._attribution_notes.values()
        if self._tracker.latest_attribution is None and self._tracker.steps and self._guard.enabled(Part.ATTRIBUTION):
            notes.append(
                NotMeasured(
                    "tensor-by-tensor attribution",
                    f"no training batch reached attribution_start_step={self.config.attribution_start_step}",
                )
            )
        return (*notes, *self._guard.not_measured)

    def _rank_summaries(self, gather_ranks: bool) -> tuple[RankSummary, ...]:
        peak = self._tracker.peak
        own = RankSummary(
            rank=self._rank,
            device_index=self._device_info.index if self._device_info is not None else None,
            peak_bytes=peak.peak_bytes if peak is not None else None,
            steps=self._tracker.steps,
        )
        gather = self._gather
        if not gather_ranks or self._world_size <= 1 or gather is None:
            return (own,)
        rows = self._exchange(lambda: gather(_rank_row(own)))
        return (own,) if rows is None else tuple(map(_rank_from_row, enumerate(rows)))

    def _exchange(self, collective: Callable[[], T]) -> T | None:
        """Run one collective with the other ranks; ``None`` where one failed, before or now (a rank gone).

        A failure warns once and ends the monitor's collectives for the run: its report covers this rank.
        """
        if not self._guard.enabled(Part.RANKS):
            return None
        try:
            return collective()
        except Exception as error:  # noqa: BLE001 -- the guard: another rank's failure must not cost this one its report
            self._guard.fail(Part.RANKS, error)
            return None

    def _meet_ranks(self, gather_ranks: bool) -> None:
        """With ``world_size > 1``, wait at the barrier until every rank is there (after rank zero wrote its files)."""
        barrier = self._barrier
        if gather_ranks and self._world_size > 1 and barrier is not None:
            self._exchange(barrier)

    def finish(self, *, gather_ranks: bool = True) -> Report | None:
        """Build the report, write its files (rank zero, with a ``log_dir``), show it, and stop measuring.

        Args:
            gather_ranks: with ``world_size > 1``, exchange each rank's headline (one collective every rank joins).

        Returns:
            The report, or ``None`` when :meth:`start` was never called or the report could not be built.
        """
        if self._probe is None or self._device_info is None or self._finished:
            return self.report
        self._finished = True
        self._close_attributor()
        ranks = self._rank_summaries(gather_ranks)
        try:
            setup = self._setup() if self._setup is not None else None
            self.report = build_report(
                self.summary(),
                setup,
                top_modules=self.config.top_modules,
                ranks=ranks,
                not_measured=self._not_measured(),
                simulation=self._simulation,
            )
        except Exception as error:  # noqa: BLE001 -- the guard
            self._guard.fail(Part.REPORT, error)
            self._meet_ranks(gather_ranks)
            self.close()
            return None
        if self._rank == 0:
            for writer in self._writers:
                self._guarded(Part.TENSORBOARD, _write_tensorboard, writer, self.report, self.report.steps)
            if self.config.console_summary:
                self._guarded(Part.CONSOLE, print_summary, self.report)
            # The files come last, so that they list every part that failed (or they are what failed).
            self.report = replace(self.report, not_measured=self._not_measured())
            if self.log_dir is not None:
                self._guarded(Part.FILES, self._write_files, self.report, self.log_dir)
            self.report = replace(self.report, not_measured=self._not_measured())
        self._meet_ranks(gather_ranks)
        self.close()
        return self.report

    def _write_files(self, report: Report, directory: Location) -> None:
        try:
            self.report_path = write_report_files(report, directory)
        except FilesNotWritten as error:  # the others were written: say where, then let the guard report it
            self.report_path = error.json_path
            raise

    def fail(self, error: BaseException) -> None:
        """The run ends with ``error``: write the report so far and, on CUDA out-of-memory, this rank's diagnosis.

        Never raises and runs no collective (other ranks may be gone): re-raise ``error`` yourself.
        """
        self._close_attributor()
        if isinstance(error, torch.cuda.OutOfMemoryError) and self._guard.enabled(Part.OOM):
            try:
                self._diagnose_oom(error)
            except Exception as failure:  # noqa: BLE001 -- the guard: the user's error must reach them unchanged
                self._guard.fail(Part.OOM, failure)
        self._phase = None
        self.finish(gather_ranks=False)

    def _diagnose_oom(self, error: BaseException) -> None:
        device, directory, model, setup = self._device_info, self.log_dir, self._model, self._setup
        if device is None or model is None or setup is None:
            return
        where = self._evaluating or (self._phase.value if self._phase is not None else "training")
        parameters, gradients, state = model_state_bytes(model, self._current_optimizers(), self._device)
        latest = self._tracker.latest_attribution
        sampled = latest.phases.get(self._phase) if latest is not None and self._phase is not None else None
        notes = []
        if sampled is None:
            notes.append(
                "activations are counted in 'other': no sampled step measured this phase before the failure"
                f" (attribution_start_step={self.config.attribution_start_step})"
            )
        elif latest is not None:
            notes.append(f"activations as counted on sampled step {latest.step}")
        snapshot = None
        if self._recording_history and isinstance(directory, Path):
            name = report_stem(SNAPSHOT_STEM, self._rank, self._world_size) + ".pickle"
            directory.mkdir(parents=True, exist_ok=True)
            snapshot = history.dump_snapshot(directory / name)
        elif self._recording_history and directory is not None:
            notes.append(f"allocator history not saved: torch writes it to local files, and {directory} is remote")
        self.oom_diagnosis = diagnose(
            error_text=str(error),
            where=where,
            step=self._tracker.steps,
            rank=self._rank,
            model_state=Breakdown(parameters, gradients, state, sampled.activations if sampled else 0, None),
            last_reading=self._tracker.boundary,
            summary=self.summary(),
            setup=setup(),
            notes=tuple(notes),
            snapshot=snapshot,
            simulation=self._simulation,
        )
        if directory is not None:
            path = write_diagnosis(self.oom_diagnosis, directory, self._world_size)
            print(f"VramMonitor (rank {self._rank}): {oom_headline(self.oom_diagnosis)}; see {path}", file=sys.stderr)

    def _close_attributor(self) -> None:
        attributor, self._attributor = self._attributor, None
        _ATTRIBUTING.discard(self)
        if attributor is not None:
            attributor.close()

    def close(self) -> None:
        """Stop measuring: remove every hook, stop NVML's thread and the allocator history. Safe to call twice."""
        self._close_attributor()
        probe, self._probe = self._probe, None
        if probe is not None:  # closed whatever failed before: its background thread must stop
            try:
                probe.close()
            except Exception as error:  # noqa: BLE001 -- the guard
                self._guard.fail(Part.PROBE, error)
        if self._recording_history:
            self._recording_history = False
            self._guarded(Part.HISTORY, history.stop_recording)
        # Let go of the run: the model, its optimizers and the callables that hold the Trainer (and through it the
        # process group, whose teardown must not wait for this object).
        self._model, self._optimizers, self._setup, self._gather, self._barrier = None, (), None, None, None
        self._writers, self._step_function, self._sampled_batch = (), None, None

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The run's aggregates as plain data, so that a report after a resume covers the whole run."""
        return {
            "version": STATE_VERSION,
            "tracker": self._tracker.state_dict(),
            "timer": self._timer.state_dict(),
            "simulation": simulation_to_dict(self._simulation),  # a resumed run keeps its replayed advice
        }

    def load_state_dict(self, state: Any) -> None:
        """Continue the run :meth:`state_dict` saved; before :meth:`start`, it is applied when the run starts.

        State that is not what :meth:`state_dict` wrote (another version, a missing or mistyped field) warns once
        and leaves the aggregates fresh.
        """
        if self._probe is None:
            self._pending_state = state
            return
        version = state.get("version") if isinstance(state, dict) else None
        if version != STATE_VERSION:
            _warn_fresh(f"its version is {version!r}, not {STATE_VERSION}")
            return
        tracker = MemoryTracker(self.config.recent_steps, self.config.reset_peak_stats)
        timer = StepTimer(self.config.recent_steps, self._clock)
        try:
            tracker.load_state_dict(state.get("tracker"))
            timer.load_state_dict(state.get("timer"))
            simulation = simulation_from_dict(state.get("simulation"))
        except FormatError as error:
            _warn_fresh(str(error))
            return
        self._tracker, self._timer, self._simulation = tracker, timer, simulation


def _warn_fresh(reason: str) -> None:
    warnings.warn(
        f"VramMonitor: the checkpoint's monitor state cannot be used ({reason}); the report covers only the run"
        " since the resume.",
        VramMonitorWarning,
        stacklevel=4,
    )


def _write_tensorboard(writer: TensorBoardWriter, report: Report, step: int) -> None:
    write_advice(writer, report.advice, step)
    write_figures(writer, report, step)


def _model_device(model: nn.Module) -> torch.device:
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


def _rank_row(summary: RankSummary) -> list[float]:
    """A rank's summary as numbers for a gather (NaN for not measured)."""
    return [
        math.nan if summary.peak_bytes is None else float(summary.peak_bytes),
        float(summary.steps),
        math.nan if summary.device_index is None else float(summary.device_index),
    ]


def _rank_from_row(item: tuple[int, list[float]]) -> RankSummary:
    rank, (peak_bytes, steps, device_index) = item
    return RankSummary(
        rank=rank,
        device_index=None if math.isnan(device_index) else int(device_index),
        peak_bytes=None if math.isnan(peak_bytes) else int(peak_bytes),
        steps=int(steps),
    )
