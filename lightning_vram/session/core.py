"""``VramSession``: the Lightning-free measuring core, wiring the parts of :mod:`lightning_vram.session`.

Every part is guarded by the run's one :class:`~lightning_vram._guard.Guard`: an error in the monitor's own code
warns once, switches that part off and is listed in the report's ``not_measured``; training goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from lightning_vram._guard import Guard, Output, Part
from lightning_vram.config import (
    MonitorConfig,
    MonitorOptions,
    check_option_names,
    check_start,
    precision_name,
    start_device,
)
from lightning_vram.exceptions import SESSION
from lightning_vram.prediction.replay.known_values import TakenValues, taken_values
from lightning_vram.prediction.replay.step import StepFunction
from lightning_vram.records import (
    Advice,
    Attribution,
    EvaluationPeak,
    NotMeasured,
    OomDiagnosis,
    Phase,
    PreflightVerdict,
    RankPreflight,
    Report,
    RunSummary,
    Simulation,
    TrainingSetup,
)
from lightning_vram.records.report import error_text
from lightning_vram.render.files import Location, as_location
from lightning_vram.render.publishers.tensorboard import TensorBoardPublisher
from lightning_vram.render.publishing import Publisher
from lightning_vram.render.scalars import chart_scalars
from lightning_vram.render.tensorboard import TensorBoardWriter
from lightning_vram.render.text import evaluation_text
from lightning_vram.session.advisor import Advisor
from lightning_vram.session.assembly import NO_SCALARS, Assembly, Gather, Ranks
from lightning_vram.session.checkpoint_state import RunState, restored_state, saved_state
from lightning_vram.session.context import Optimizers, RunContext, run_context
from lightning_vram.session.evaluation import EvaluationLoops
from lightning_vram.session.recorder import AllocatorHistory, StepRecorder
from lightning_vram.session.sampling import Sampler
from lightning_vram.session.sinks import Sinks

EPOCH_ADVICE = Output("advice at each epoch's end")
"""The advice so far, built at each epoch's end for the publishers (its failure leaves the report's alone)."""
DEFAULT_LOG_EVERY_N_STEPS = 50
"""Steps between interval scalars when neither the session nor a Trainer sets it (Lightning's default)."""
WINDOW = Output("the accumulation window read at a sampled step")
"""The training set-up read at a sampled step for its window (its failure leaves the sampled step alone)."""


class VramSession:
    """Where device memory goes during training, phase by phase, for any training loop.

    Every step, the allocator's peak is read at the phase boundaries from host-side counters, without synchronising
    the device. On sampled steps the tensors are counted one by one: parameters, gradients, optimizer state and the
    activations each module saves for backward. :meth:`finish` builds the :class:`~lightning_vram.records.Report`
    and writes ``vram_report.json``, ``.md`` and ``.html`` into ``log_dir``.

    Args:
        log_dir: directory for the report files: a local path, or a URL fsspec can write to (``s3://...``, as
            Lightning's loggers take it); ``None`` writes none (the report is still returned).
        **options: the monitor's options, documented in :class:`~lightning_vram.config.MonitorOptions`
            (``log_every_n_steps`` is 50 here when not given, the Trainer's setting under
            :class:`~lightning_vram.VramMonitor`).

    Raises:
        TypeError, ValueError: an argument is not what it must be (the message names it, what it must be and what it
            got).
    """

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None, **options: Unpack[MonitorOptions]) -> None:
        check_option_names("VramSession", options, own=("log_dir",))
        self.config = MonitorConfig(**options)
        """The options, checked."""
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir must be a path (str or os.PathLike) or None, got {type(log_dir).__name__}")
        if log_dir is not None and not os.fspath(log_dir):
            raise ValueError("log_dir must be a directory path or None, got an empty path ''")
        self.log_dir: Location | None = as_location(log_dir) if log_dir is not None else None
        """Where :meth:`finish` writes the report files: a ``Path``, a remote URL as a string, or ``None`` for none."""
        self.report: Report | None = None
        """The report of the last run, set by :meth:`finish` (also after :meth:`fail`)."""
        self.oom_diagnosis: OomDiagnosis | None = None
        """This rank's diagnosis when the run ended with a CUDA out-of-memory error."""
        self._pending_state: Any = None
        self._owner = SESSION  # the object the user made, which warnings begin with: VramMonitor sets its own name
        self._started = False  # start() has returned: the step methods before it raise
        self._new_run(RunContext(), Ranks(Guard(self._owner)))

    def _new_run(self, context: RunContext, ranks: Ranks, publishers: Sequence[Publisher] = ()) -> None:
        """Fresh parts for the run of ``context``, sharing one guard; ``publishers`` get its results."""
        config = self.config
        self._guard = guard = ranks.guard
        self._context = context
        self._recorder = recorder = StepRecorder(config, guard)
        self._sampler = Sampler(config, guard, context)
        self._advisor = Advisor(config, guard, context)
        self._history = AllocatorHistory(guard)
        self._ranks = ranks
        self._sinks = Sinks(guard, publishers, config.console_summary)
        self._assembly = Assembly(config, guard, recorder, self._ranks, self._notes, self._advisor.length_peaks)
        self._log_every: int | None = None
        self._step: int | None = None  # the last step published at
        self._evaluation = EvaluationLoops(config, context, recorder)
        self._finished = False
        self._sampled_batch: Any = None
        self._sampled_values: TakenValues | None = None  # its small CPU tensors' values as it started
        self._worst_batch = False  # whether the sampled batch is replayed as a new largest one
        self._held_for: int | None = None  # the stepping micro-batch last sampled to hold a sampled window's gradients
        self._preflight_pending = True

    def _notes(self) -> list[NotMeasured]:
        """What the allocator history and the sampled steps could not measure.

        A bound method, not a closure: the session must pickle (``ddp_spawn`` pickles the callback).
        """
        note = self._history.note
        return [*([note] if note is not None else []), *self._sampler.notes()]

    @property
    def report_path(self) -> Location | None:
        """Where ``vram_report.json`` was written (rank zero, with a ``log_dir``); ``None`` when it was not.

        A ``Path`` on a local disk, the URL as a string on a remote filesystem (a ``Path`` would collapse its ``//``).
        """
        return self._sinks.report_path

    @property
    def preflight_verdict(self) -> PreflightVerdict | None:
        """The first step replayed against the device's free memory before it ran (CUDA, ``preflight=True``)."""
        return self._advisor.preflight_verdict

    @property
    def preflight_ranks(self) -> tuple[RankPreflight, ...]:
        """Every rank's preflight verdict, rank by rank, as the ranks agreed on it before step 0.

        One gather; this rank's alone with one process or no gather; empty before the first step or with preflight
        off.
        """
        return self._advisor.preflight_ranks

    @property
    def simulation(self) -> Simulation | None:
        """The replay of the run's sampled step and of each change tried on it (``None`` before it ran)."""
        return self._advisor.simulation

    # ------------------------------------------------------------------------------------------------ set-up

    def start(
        self,
        model: nn.Module,
        optimizers: Optimizers = (),
        *,
        dataloader: Any = None,
        precision: str | int = "32-true",
        device: torch.device | None = None,
        setup: Callable[[], TrainingSetup] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        gather: Gather | None = None,
        barrier: Callable[[], None] | None = None,
        tensorboard: Sequence[TensorBoardWriter] = (),
        publishers: Sequence[Publisher] = (),
        default_log_every_n_steps: int | None = DEFAULT_LOG_EVERY_N_STEPS,
        step_function: StepFunction | None = None,
        wrapper: Callable[[], nn.Module | None] | None = None,
        accumulate_grad_batches: int | None = None,
    ) -> None:
        """Start measuring a run of ``model`` (on its device) with ``optimizers``.

        Args:
            model: the module trained; its parameters' device is the one measured unless ``device`` is given.
            optimizers: its optimizers, or a callable returning them (read again on each sampled step).
            dataloader: the training DataLoader, so advice can read ``num_workers`` and ``pin_memory``.
            precision: the precision trained in, as Lightning names it (``"32-true"``, ``"bf16-mixed"``...); its older
                names are taken as Lightning takes them (``"bf16"`` is ``"bf16-mixed"``, ``16`` is ``"16-mixed"``).
            device: the device to measure, when the model's first parameter is not on it (a ``torch.device`` or a
                device string such as ``"cuda:1"``).
            setup: a callable returning the training set-up for advice (the callback reads its Trainer); default:
                one read from ``model``, ``optimizers``, ``dataloader`` and ``precision``. Read once per epoch, the
                first time advice needs it (training has started then; a Trainer's window may change between epochs).
            rank: this process's global rank; default: ``torch.distributed``'s where a process group is initialized
                (a plain loop's rank 1 of a ZeRO-2 run started without it was replayed as rank 0, its replay refused
                on the gradients crossing its partition's edges), else 0.
            world_size: the number of processes training together; default: ``torch.distributed``'s where a process
                group is initialized, else 1.
            gather: every rank's numbers (one collective), with ``world_size > 1``: the report's per-rank headlines,
                logged maxima and preflight's verdicts then cover every rank; without it each covers this rank.
            barrier: waits until every rank calls it (one collective): with ``world_size > 1``, :meth:`finish`
                holds the other ranks there until rank zero has written the files. A collective that fails (a rank
                gone) warns once; the monitor runs no other one, and its report covers this rank.
            tensorboard: SummaryWriters that get the custom-scalars layout, the advice text and the figures (the
                scalars :meth:`batch_end` returns are yours to log).
            publishers: where the scalars (at the step given to :meth:`batch_end`), the figures, the advice, the
                report files, the advice ids as tags and the peak go: a :class:`~lightning_vram.Publisher` each,
                ``lightning_vram.publisher_for(logger)`` for a Lightning logger. Each that fails warns once and is
                switched off.
            default_log_every_n_steps: the interval when ``log_every_n_steps`` was not given; ``None`` logs none.
            step_function: ``(module, batch) -> loss``: the forward pass and loss of one step, so that advice can be
                replayed on it under fake tensors; a module with a ``training_step`` (a LightningModule) needs none.
            wrapper: returns the module training runs ``model`` through, where a strategy wraps it (a
                ``DistributedDataParallel``; the callback passes its strategy's ``model``): read on sampled steps,
                so that DDP's gradient buckets are counted in the CPU's live peak and held by each rank's replay.
            accumulate_grad_batches: batches whose gradients add up before each optimizer step, where the loop
                accumulates gradients (the replay then runs a window's micro-batches). Observed too: a batch that
                ends without :meth:`before_optimizer_step` is a micro-batch of a window, and once the optimizer has
                stepped the window observed is used (a declared one that differs warns once). Default: observed,
                else 1; with ``setup`` given, the set-up's own value (the callback's: the Trainer's setting).

        Raises:
            TypeError, ValueError: an argument is not what it must be (the message names it); nothing starts.
        """
        rank_, world_size_ = process_rank(rank, world_size)
        check_start(
            model,
            optimizers,
            precision=precision,
            setup=setup,
            rank=rank_,
            world_size=world_size_,
            gather=gather,
            barrier=barrier,
            tensorboard=tensorboard,
            publishers=publishers,
            default_log_every_n_steps=default_log_every_n_steps,
            step_function=step_function,
            wrapper=wrapper,
            accumulate_grad_batches=accumulate_grad_batches,
        )
        device = start_device(device)
        context = run_context(
            model,
            optimizers,
            dataloader,
            precision_name(precision),
            device,
            setup,
            step_function,
            accumulate_grad_batches,
        )
        context.rank, context.world_size, context.wrapper = rank_, world_size_, wrapper
        self.close()  # a run left unfinished (its loop died without fail()) lets go of its hooks and probe first
        outputs = [*(TensorBoardPublisher(writer=writer) for writer in tensorboard), *publishers]
        self._new_run(context, Ranks(Guard(self._owner), rank_, world_size_, gather, barrier), outputs)
        self.report = self.oom_diagnosis = None
        config = self.config
        self._log_every = config.log_every_n_steps or default_log_every_n_steps
        self._recorder.open(config.probe, context.device, config.utilization_interval_seconds)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        if config.record_history:
            self._history.start(context.device, config.history_max_entries)
        self._started = True

    def _require_start(self, method: str) -> None:
        """Raise where :meth:`start` has never returned: a step method called before it would measure nothing."""
        if not self._started:
            raise RuntimeError(
                f"VramSession.{method}() needs start() first: call session.start(model, optimizers) once before the"
                " training loop's first step; nothing is measured before it"
            )

    # ------------------------------------------------------------------------------------------------ hot path

    def batch_start(self, batch: Any = None) -> None:
        """A training step starts (before its forward pass). ``batch`` gives the batch size on sampled steps.

        Raises:
            RuntimeError: :meth:`start` was never called (as do the other step methods).
        """
        recorder, sampler = self._recorder, self._sampler
        if recorder.probe is None or self._finished:
            self._require_start("batch_start")
            if self._preflight_pending and not self._finished:  # the other ranks' preflight gather waits for this one
                self._agree_preflight(RankPreflight(self._context.rank, None, skipped="no probe on this rank"))
            return
        if sampler.attributor is not None:  # the last sampled step never ended (its batch stopped at its start hook)
            sampler.close()
            self._sampled_batch = None
            self._sampled_values = None
        every, step = self._log_every, recorder.tracker.steps
        reading = recorder.start_step(every is not None and (step + 1) % every == 0)
        if self._preflight_pending:  # the run's first step: read phase by phase, `reading` is there
            device, rank = recorder.device, self._context.rank
            own = RankPreflight(rank, None, skipped="no device")
            if device is not None:
                own = self._advisor.preflight(batch, reading, recorder.probe, device)
            self._agree_preflight(own)
        due = sampler.next_step
        live = not recorder.reads_allocator  # no allocator measures the peak (the CPU): the sampled step counts all
        # Every step records its batch's shapes; one larger than any replayed is counted and replayed at its end (a
        # few times a run at most); every other step but a few stops at `due`, without a call.
        worst = recorder.observe_batch(step, batch) and self._advisor.worth_counting(recorder.shapes.largest_elements)
        candidate = worst or (due is not None and step >= due)
        kept = worst or self._advisor.simulation is None  # a sampled step to replay at its end
        values = None
        if candidate:  # a step that may be sampled is read phase by phase, from before the sampler starts
            recorder.read_by_phase()
        if candidate and kept:  # before the step changes its batch, and before the sampler counts anything
            values = self._guard.call(Part.REPLAY, taken_values, batch)
        sampled = candidate and sampler.begin(step, batch, live, force=worst)
        if sampled and sampler.replay_refusal is not None:
            self._advisor.refuse(sampler.replay_refusal)
        elif sampled and kept:
            self._sampled_batch = batch  # replayed at the step's end (its shapes and dtypes only)
            self._sampled_values = values
            self._worst_batch = worst

    def _agree_preflight(self, own: RankPreflight) -> None:
        """Once a run, before step 0: the ranks agree on every rank's preflight verdict (one gather), then warn.

        Every rank joins the gather exactly once, at its first :meth:`batch_start`, whatever its own preflight did
        (``own`` carries ``fits=None`` where it was skipped); with preflight off on every rank (``preflight=False``
        or no replay budget: options every rank shares) no rank joins.
        """
        self._preflight_pending = False
        config = self.config
        if not config.preflight or config.replay_budget_seconds <= 0:
            return
        self._advisor.warn_preflight(self._ranks.agree_preflight(own))

    def before_backward(self) -> None:
        """A backward pass is about to run: what ran since the last boundary was a forward pass."""
        if self._recorder.phase is None:
            self._require_start("before_backward")
            return
        self._recorder.boundary(Phase.FORWARD, Phase.BACKWARD)
        if self._sampler.attributor is not None:
            self._sampler.before_backward()

    def after_backward(self) -> None:
        """A backward pass has returned (optional: a loop that runs several backward passes a step calls it).

        The segment since :meth:`before_backward` ends as backward. What runs next counts as a forward pass where it
        ends at the next :meth:`before_backward`, else as backward (the code before the optimizer step, as a loop
        that never calls this has it). Nothing happens outside a backward pass.
        """
        if self._recorder.phase is not Phase.BACKWARD:
            self._require_start("after_backward")
            return
        self._recorder.boundary(Phase.BACKWARD, Phase.BACKWARD)
        if self._sampler.attributor is not None:
            self._sampler.after_backward()

    def after_optimizer_step(self) -> None:
        """An optimizer's update has returned (optional: a loop that steps several optimizers a step calls it).

        The segment since :meth:`before_optimizer_step` ends as the optimizer phase. What runs next counts as a
        forward pass where it ends at the next :meth:`before_backward` (a GAN's second network), else with the
        optimizer phase (another optimizer's step, the step's end). Without it, the first optimizer's update and the
        forward pass after it are one segment, counted as forward. Nothing happens outside an optimizer step.
        """
        if self._recorder.phase is not Phase.OPTIMIZER:
            self._require_start("after_optimizer_step")
            return
        self._recorder.boundary(Phase.OPTIMIZER, Phase.OPTIMIZER)
        if self._sampler.attributor is not None:
            self._sampler.after_optimizer_step()

    def before_optimizer_step(self) -> None:
        """An optimizer is about to step: the segment since the last boundary (usually backward) ends."""
        recorder = self._recorder
        phase = recorder.phase
        if phase is None:
            self._require_start("before_optimizer_step")
            return
        recorder.boundary(phase, Phase.OPTIMIZER)
        recorder.tracker.count_optimizer_step()
        self._context.windows.optimizer_step()
        if self._sampler.attributor is not None:
            self._sampler.before_optimizer_step()

    def batch_end(self, step: int | None = None) -> Mapping[str, float]:
        """The training step ended. Returns the ``vram/...`` scalars when a log interval ends, else an empty dict.

        Each ``..._bytes`` value comes with its ``..._mib`` twin (mebibytes), as the publishers log them.

        Args:
            step: the step the publishers log the scalars at (the logger's counter); default: the steps measured.

        With ``world_size > 1`` every rank must call it at the same steps: an interval's end is one gather.
        """
        recorder = self._recorder
        phase = recorder.phase
        if phase is None:
            self._require_start("batch_end")
            return NO_SCALARS
        windows, sampler = self._context.windows, self._sampler
        if sampler.attributor is None:  # every step but the sampled ones: one call
            windows.batch_end()
            steps = recorder.end_step(phase)
            self._sampled_batch = None
            self._sampled_values = None
        else:
            place = self._hold_the_window(recorder.tracker.steps)
            windows.batch_end()
            recorder.boundary(phase, None)
            attribution = sampler.finish()
            if attribution is not None and place is not None:
                attribution = replace(attribution, micro_batch=place)
            steps = recorder.fold_step(attribution)
            recorder.end_timing()
            batch = self._sampled_batch
            if attribution is not None and batch is not None and not self._waits_for_window(attribution):
                shapes = recorder.shapes
                size = (shapes.elements, self._guard.call(Part.SHAPES, shapes.length_of, batch))
                values, worst = self._sampled_values, self._worst_batch
                self._advisor.replay(attribution, batch, self.summary, size, worst, sampler.released_late, values)
                recorder.timer.restart_wait()  # the replay's time is neither this step's nor the next one's data wait
            sampler.forget_late_releases()
            self._sampled_batch = None
            self._sampled_values = None
        resample = self._context.windows.resample_at(steps)
        if resample is not None:
            sampler.sample_at(resample)
        every = self._log_every
        if every is None or steps % every != 0:
            return NO_SCALARS
        scalars = chart_scalars(self._assembly.interval_scalars())  # with the ``_mib`` twins the charts show
        self._step = steps if step is None else step
        if scalars and self._sinks.publishers:
            self._sinks.scalars(scalars, self._step)
        return scalars

    def _hold_the_window(self, step: int) -> int | None:
        """Under gradient accumulation, the sampled ``step``'s place in its window (``None``: none, or not known).

        Read before the window ends the batch.

        A sampled micro-batch that does not step may hold less than the window's later ones (the first holds no
        gradients before its backward): the window's stepping micro-batch is sampled too, so that the run's peak is
        measured on one holding the window's gradients. Once per sampled step, not again from the one sampled so.
        """
        windows = self._context.windows
        training = self._guard.call(WINDOW, self._context.setup)
        window = training.accumulate_grad_batches if training is not None else windows.window(1)
        if window <= 1:
            return None
        stepping = windows.stepping_step(step, window)
        if stepping is not None and step != self._held_for:
            self._held_for = stepping
            self._sampler.sample_at(stepping)
        return windows.place()

    def _waits_for_window(self, attribution: Attribution) -> bool:
        """Whether the replay of the sampled step waits for the loop's accumulation window (see ``accumulation``).

        Before any optimizer step, the next batch is sampled too: its end may show the window (or a loop that never
        calls :meth:`before_optimizer_step` replays it as before).
        """
        windows = self._context.windows
        forward = attribution.phases.get(Phase.FORWARD)
        if not windows.defers(attribution.step, forward.gradients if forward is not None else 0):
            return False
        if not windows.steps_seen:
            self._sampler.sample_at(attribution.step + 1)
        return True

    def break_continuity(self) -> None:
        """The time until the next training step is not data wait (an epoch boundary, a validation run)."""
        self._recorder.timer.break_continuity()

    # ------------------------------------------------------------------------------------------------ intervals

    def epoch_end(self, step: int) -> None:
        """Publish the advice so far as text at ``step`` (with publishers or writers given to :meth:`start`).

        The next epoch's set-up is read again when needed: its accumulation window may differ (a Trainer's
        ``GradientAccumulationScheduler``), and a replay under the old one would not reproduce its steps.
        """
        self._publish_epoch_advice(step)
        self._context.epoch_ended()

    def _publish_epoch_advice(self, step: int) -> None:
        recorder = self._recorder
        if not self._sinks.publishers or recorder.probe is None or recorder.device is None:
            return
        self._step = step

        def advice() -> tuple[Advice, ...]:
            setup = self._context.setup()
            return self._advisor.advice(self.summary(), setup) if setup is not None else ()

        so_far = self._guard.call(EPOCH_ADVICE, advice)
        if so_far is not None:
            self._sinks.advice(so_far, step)

    # ------------------------------------------------------------------------------------------------ evaluation

    def start_evaluation(self, stage: str, model: nn.Module | None = None) -> None:
        """An evaluation loop (``validation``, ``test`` or ``predict``) starts; outside a run it is measured alone."""
        self._evaluation.start(stage, model)

    def evaluation_batch_start(self, batch: Any = None) -> None:
        """An evaluation batch starts (``batch``: read for its size only, where an out-of-memory error names it)."""
        self._evaluation.batch_start(batch)

    def evaluation_batch_end(self) -> None:
        """The evaluation batch ends: its allocator peak is kept if it is its stage's highest."""
        self._evaluation.batch_end()

    def end_evaluation(self) -> EvaluationPeak | None:
        """The evaluation loop ends; returns its stage's peak when it was measured alone (else ``None``)."""
        stage = self._evaluation.end()
        if stage is None:
            return None
        self.close()
        return self._recorder.tracker.evaluation.get(stage)

    @property
    def evaluation_peaks(self) -> dict[str, EvaluationPeak]:
        """The highest evaluation-batch peak of each stage (validation, test, predict) measured (CUDA)."""
        return dict(self._recorder.tracker.evaluation)

    @staticmethod
    def evaluation_line(peak: EvaluationPeak, device: torch.device) -> str:
        """The console line for a standalone evaluation's peak."""
        return f"VRAM: {evaluation_text((peak,))} on {device}"

    # ------------------------------------------------------------------------------------------------ the end

    def summary(self) -> RunSummary:
        """What the run measured so far.

        Raises:
            RuntimeError: :meth:`start` was never called.
        """
        return self._assembly.summary()

    def finish(self, *, gather_ranks: bool = True, step: int | None = None) -> Report | None:
        """Build the report, write its files (rank zero, with a ``log_dir``), show it, and stop measuring.

        Args:
            gather_ranks: with ``world_size > 1``, exchange each rank's headline (one collective every rank joins).
            step: the step the publishers show the figures and advice at; default: the last one published at, else
                the steps measured.

        Returns:
            The report, or ``None`` when :meth:`start` was never called or the report could not be built.
        """
        return self._finish(gather_ranks, step, None)

    def _finish(self, gather_ranks: bool, step: int | None, ended_with: str | None) -> Report | None:
        """:meth:`finish`, the report saying that the run ended with ``ended_with`` (an error, in words) if given."""
        recorder = self._recorder
        if recorder.probe is None or recorder.device is None or self._finished:
            return self.report
        self._finished = True
        self._sampler.close()
        assembly = self._assembly
        report = assembly.report(self._context.setup, self._advisor.simulation, gather_ranks)
        if report is not None:
            report = replace(report, shapes=self._advisor.shapes(self._recorder.shapes.record()), ended_with=ended_with)
            self.report = report
            if self._context.rank == 0:
                at = step if step is not None else self._step if self._step is not None else report.steps
                self.report = self._sinks.publish(report, self.log_dir, assembly.not_measured, at)
        self._ranks.meet(gather_ranks)
        self.close()
        return self.report if report is not None else None

    def fail(self, error: BaseException) -> None:
        """The run ends with ``error``: write the report so far and, on CUDA out-of-memory, this rank's diagnosis.

        Never raises and runs no collective (other ranks may be gone): re-raise ``error`` yourself.
        """
        self._sampler.close()
        if isinstance(error, torch.cuda.OutOfMemoryError):
            self._guard.call(Part.OOM, self._diagnose_oom, error)
        self._recorder.phase = None
        self._finish(False, None, error_text(error))

    def _diagnose_oom(self, error: BaseException) -> None:
        context, recorder, sinks, directory = self._context, self._recorder, self._sinks, self.log_dir
        if recorder.device is None or context.model is None or context.read_setup is None:
            return
        phase = recorder.phase
        where = self._evaluation.stage or (phase.value if phase is not None else "training")
        snapshot = sinks.snapshot(directory, context.rank, context.world_size) if self._history.recording else None
        evaluation_batch = self._evaluation.batch_size if self._evaluation.stage is not None else None
        diagnosis = self._advisor.diagnose_oom(
            error, where, phase, recorder.tracker, self.summary(), snapshot, evaluation_batch
        )
        if diagnosis is not None:
            self.oom_diagnosis = diagnosis
            sinks.diagnosis(diagnosis, directory, context.rank, context.world_size)

    def close(self) -> None:
        """Stop measuring: remove every hook, stop NVML's thread and the allocator history. Safe to call twice."""
        self._sampler.close()
        self._recorder.close()
        self._history.stop()
        # Let go of the run: the model, its optimizers and the callables that hold the Trainer (and through it the
        # process group, whose teardown must not wait for this object).
        self._context.release()
        self._ranks.release()
        self._sinks.attach(())
        self._sampled_batch = None
        self._sampled_values = None

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The run's aggregates as plain data, so that a report after a resume covers the whole run."""
        recorder = self._recorder
        return saved_state(RunState(recorder.tracker, recorder.timer, self._advisor.simulation))

    def load_state_dict(self, state: Any) -> None:
        """Continue the run :meth:`state_dict` saved; before :meth:`start`, it is applied when the run starts.

        State that is not what :meth:`state_dict` wrote (another version, a missing or mistyped field) warns once
        and leaves the aggregates fresh.
        """
        if self._recorder.probe is None:
            self._pending_state = state
            return
        restored = restored_state(state, self.config, self._guard.owner)
        self._context.windows.resumed()
        if restored is not None:
            self._recorder.restore(restored.tracker, restored.timer)
            self._advisor.simulation = restored.simulation


def process_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size`` as given, each ``None`` from the process group.

    ``torch.distributed``'s initialized process group gives them; without one, 0 and 1.
    """
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    if world_size is None:
        world_size = torch.distributed.get_world_size() if initialized else 1
    return rank, world_size
