"""``VramMonitor``: the Lightning callback. Glue only: hooks in, measurements out to the parts below it."""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_vram import history
from lightning_vram.accounting import StepAttributor, model_state_bytes
from lightning_vram.advice import RunSummary, advise, fit_table
from lightning_vram.config import MonitorConfig
from lightning_vram.console import print_summary
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.metrics import interval_scalars, reduce_over_ranks, scalar_vector
from lightning_vram.oom import SNAPSHOT_STEM, OomDiagnosis, diagnose, report_stem, write_diagnosis
from lightning_vram.probes import Probe, probe_for
from lightning_vram.records import AllocatorReading, Breakdown, DeviceInfo, EvaluationPeak, NotMeasured, Phase
from lightning_vram.report import RankSummary, Report, TimingSummary, evaluation_text, largest_savers
from lightning_vram.report_files import write_report_files
from lightning_vram.state import STATE_VERSION
from lightning_vram.tensorboard import TensorBoardWriter, write_advice, write_figures, write_layout
from lightning_vram.timing import StepTimer
from lightning_vram.tracker import MeasuredPhase, MemoryTracker, phase_peak_bytes
from lightning_vram.training_setup import training_setup

ATTRIBUTION_FAILED = "per-module activations"


class VramMonitor(Callback):
    """Where GPU memory goes during training, phase by phase, and how busy the GPU is.

    Every training step, the allocator's peak is read at Lightning's phase boundaries (forward,
    backward, optimizer step) from host-side counters, without synchronising the device. On sampled
    steps the tensors are counted one by one: parameters, gradients, optimizer state and the
    activations each module saves for backward. Scalars go to the Trainer's loggers every
    ``log_every_n_steps``; after fit, :attr:`report` holds the :class:`~lightning_vram.report.Report`
    and ``vram_report.json`` is written to the Trainer's ``log_dir`` (``default_root_dir`` without a logger).

    Args:
        log_every_n_steps: training batches between logged scalars; ``None`` uses the Trainer's setting.
        attribution_start_step: the first training batch (0-based, over the whole run) counted tensor by
            tensor. The default, 2, skips the first step, where optimizer state is still being created.
        attribution_every_n_steps: batches between counted steps after the first; ``None`` counts one step.
            A counted step costs extra Python time per saved tensor.
        reset_peak_stats: reset the CUDA allocator's peak at each phase boundary to measure exact phase
            peaks. This is process-wide: code of yours that reads ``torch.cuda.max_memory_allocated()``
            sees the peak since the last boundary. ``False`` leaves it untouched; phase peaks are then
            exact when they set a new process peak and a lower bound otherwise.
        utilization_interval_seconds: seconds between NVML utilization samples (background thread).
        top_modules: how many modules the report lists by saved activation bytes.
        recent_steps: how many recent step peaks are kept for charts (memory stays bounded).
        console_summary: print a short summary at the end of training (global rank zero).
        record_history: record the CUDA allocator's history (every allocation and free with its Python stack)
            so that an out-of-memory error also leaves a snapshot for PyTorch's memory visualizer. Off by
            default: recording costs host time on every allocation and holds up to ``history_max_entries``
            events in memory.
        history_max_entries: allocation events the history keeps (the oldest are dropped).
        probe: read the device through this probe instead of the one that fits the device; for tests,
            see :class:`lightning_vram.testing.ScriptedProbe`.
    """

    def __init__(
        self,
        *,
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
        probe: Probe | None = None,
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
        )
        if probe is not None and not isinstance(probe, Probe):
            raise TypeError(f"probe must implement lightning_vram.probes.Probe, got {type(probe).__name__}")
        self._probe_override = probe
        self.report: Report | None = None
        """The report of the last fit, set when training ends (also when it ends by an exception)."""
        self.report_path: Path | None = None
        """Where ``vram_report.json`` was written, on global rank zero."""
        self.oom_diagnosis: OomDiagnosis | None = None
        """This rank's diagnosis when fit ended with a CUDA out-of-memory error."""
        self._resumed_state: dict[str, Any] | None = None
        self.evaluation_peaks: dict[str, EvaluationPeak] = {}
        """The highest evaluation-batch peak of each stage (validation, test, predict) last measured (CUDA)."""
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._probe: Probe | None = None
        self._device = torch.device("cpu")
        self._device_info: DeviceInfo | None = None
        self._report_dir: Path | None = None
        self._log_every: int | None = None
        self._tracker = MemoryTracker(self.config.recent_steps)
        self._timer = StepTimer(self.config.recent_steps)
        self._attributor: StepAttributor | None = None
        self._attribution_disabled: NotMeasured | None = None
        self._phase: Phase | None = None
        self._boundary: AllocatorReading | None = None
        self._measured: dict[Phase, MeasuredPhase] = {}
        self._cuda_context_bytes: int | None = None
        self._evaluating: str | None = None
        self._evaluation_boundary: AllocatorReading | None = None
        self._standalone_evaluation = False
        self._compiled_note: NotMeasured | None = None
        self._history_unavailable: NotMeasured | None = None
        self._recording_history = False

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_run_state()
        if self._resumed_state is not None:
            self._apply_state(self._resumed_state)
            self._resumed_state = None
        self.report = None
        self.oom_diagnosis = None
        self._device = pl_module.device
        probe = self._probe_override or probe_for(self._device, self.config.utilization_interval_seconds)
        device_info = probe.open(self._device)
        self._device_info = device_info
        self._probe = probe
        if device_info.type != "cuda":
            warnings.warn(
                f"VramMonitor: the model trains on {self._device}, not a CUDA GPU: allocator peaks, 'other' memory"
                " and GPU utilization are not measured; tensors are still counted.",
                VramMonitorWarning,
                stacklevel=2,
            )
        # Lightning sets this plain attribute on every Trainer; 0 means logging is off (barebones).
        trainer_interval = int(getattr(trainer, "log_every_n_steps", 50))
        self._log_every = self.config.log_every_n_steps or trainer_interval or None
        self._report_dir = Path(trainer.log_dir or trainer.default_root_dir)
        for writer in self._tensorboard_writers(trainer):
            write_layout(writer)
        if self.config.record_history:
            self._start_history(device_info)

    def _start_history(self, device_info: DeviceInfo) -> None:
        reason = history.unavailable_reason() if device_info.type == "cuda" else "training does not run on CUDA"
        if reason is None:
            history.start_recording(self.config.history_max_entries)
            self._recording_history = True
            return
        self._history_unavailable = NotMeasured("allocator history (record_history=True)", reason)
        warnings.warn(f"VramMonitor: record_history is off: {reason}.", VramMonitorWarning, stacklevel=3)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The run's aggregates, so that the report after a resume covers the whole run."""
        return {"version": STATE_VERSION, "tracker": self._tracker.state_dict(), "timer": self._timer.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start (which starts a new run state) for most strategies,
        # and after it for those that restore after setup (FSDP, DeepSpeed).
        if self._probe is None:
            self._resumed_state = state_dict
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            warnings.warn(
                f"VramMonitor: checkpoint state version {state.get('version')!r} is not {STATE_VERSION};"
                " the report covers only the run since the resume.",
                VramMonitorWarning,
                stacklevel=2,
            )
            return
        self._tracker.load_state_dict(state["tracker"])
        self._timer.load_state_dict(state["timer"])

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer.break_continuity()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer.break_continuity()
        self._start_evaluation(pl_module, "validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_evaluation(pl_module, "test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_evaluation(pl_module, "predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._evaluation_batch_start()

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch_end()

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._evaluation_batch_start()

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch_end()

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._evaluation_batch_start()

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._evaluation_batch_end()

    def _start_evaluation(self, pl_module: pl.LightningModule, stage: str) -> None:
        self._evaluating = stage
        if self._probe is None:  # trainer.validate/test/predict outside fit: measure this loop alone
            self._device = pl_module.device
            probe = self._probe_override or probe_for(self._device, self.config.utilization_interval_seconds)
            self._device_info = probe.open(self._device)
            self._probe = probe
            self._standalone_evaluation = True

    def _evaluation_batch_start(self) -> None:
        if self._probe is not None:
            self._evaluation_boundary = self._probe.read_allocator(self.config.reset_peak_stats)

    def _evaluation_batch_end(self) -> None:
        probe, start, stage = self._probe, self._evaluation_boundary, self._evaluating
        if probe is None or stage is None:
            return
        reading = probe.read_allocator(self.config.reset_peak_stats)
        if reading is None or start is None:
            return
        peak_bytes = phase_peak_bytes(start, reading, self.config.reset_peak_stats)
        peak = EvaluationPeak(stage, peak_bytes, reading.reserved_bytes, self._tracker.steps)
        known = self.evaluation_peaks.get(stage)
        if known is None or peak.peak_bytes > known.peak_bytes:
            self.evaluation_peaks[stage] = peak
        if not self._standalone_evaluation:
            self._tracker.record_evaluation(peak)

    def _end_evaluation(self, trainer: pl.Trainer) -> None:
        stage, self._evaluating = self._evaluating, None
        if not self._standalone_evaluation or stage is None:
            return
        peak = self.evaluation_peaks.get(stage)
        if peak is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(
                    {f"vram/evaluation/{stage}_peak_bytes": float(peak.peak_bytes)}, step=trainer.global_step
                )
            if self.config.console_summary:
                print(f"VRAM: {evaluation_text((peak,))} on {self._device}")
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._standalone_evaluation = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        probe = self._probe
        if probe is None:
            return
        self._timer.batch_started(time.perf_counter())
        self._phase = Phase.FORWARD
        self._measured = {}
        self._boundary = probe.read_allocator(self.config.reset_peak_stats)
        if self._boundary is not None:
            self._tracker.observe_ooms(self._boundary.ooms)
        if self._attribution_disabled is None and self.config.is_sampled(self._tracker.steps):
            self._start_attribution(trainer, pl_module, batch)

    def _start_attribution(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        attributor = StepAttributor(self._tracker.steps, pl_module, list(trainer.optimizers), self._device)
        try:
            attributor.begin_forward(batch)
        except RuntimeError as error:  # saved-tensor hooks refused (disabled by the user's code or a compiler)
            attributor.close()
            self._attribution_disabled = NotMeasured(ATTRIBUTION_FAILED, f"saved-tensor hooks unavailable: {error}")
            warnings.warn(
                f"VramMonitor: {self._attribution_disabled.reason}; activations are not attributed.",
                VramMonitorWarning,
                stacklevel=2,
            )
            return
        self._attributor = attributor
        if attributor.compiled and self._compiled_note is None:
            self._compiled_note = NotMeasured(
                "per-module activations inside compiled modules",
                f"{', '.join(attributor.compiled)} run(s) as torch.compile graphs: their saved tensors are counted"
                " and charged to the compiled module as a whole",
            )

    def _close_segment(self, label: Phase, next_phase: Phase | None) -> None:
        """End the segment since the last boundary as ``label``: read the allocator once and keep its peak.

        A phase met twice in one step (manual optimization) keeps its highest peak and its latest counters.
        """
        probe = self._probe
        if self._phase is None or probe is None:
            return
        reading = probe.read_allocator(self.config.reset_peak_stats)
        if reading is not None:
            self._tracker.observe_ooms(reading.ooms)
        if reading is not None and self._boundary is not None:
            peak = phase_peak_bytes(self._boundary, reading, self.config.reset_peak_stats)
            known = self._measured.get(label)
            self._measured[label] = MeasuredPhase(
                peak_bytes=max(peak, known.peak_bytes) if known is not None else peak,
                allocated_bytes=reading.allocated_bytes,
                reserved_bytes=reading.reserved_bytes,
                alloc_retries=reading.alloc_retries,
            )
        self._boundary = reading
        self._phase = next_phase

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # What ran since the last boundary ended in a loss: a forward pass (with manual optimization it may
        # also hold the previous optimizer's update).
        if self._phase is None:
            return
        self._close_segment(Phase.FORWARD, Phase.BACKWARD)
        if self._attributor is not None:
            self._attributor.before_backward()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._phase is None:
            return
        self._close_segment(self._phase, Phase.OPTIMIZER)
        if self._attributor is not None:
            self._attributor.before_optimizer_step()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self._phase is None:
            return
        step = self._tracker.steps
        self._close_segment(self._phase, None)
        attribution = None
        if self._attributor is not None:
            attribution = self._attributor.finish()
            self._attributor = None
        self._tracker.update(step, self._measured, attribution)
        self._timer.batch_ended(time.perf_counter())
        if self._log_every is not None and self._tracker.steps % self._log_every == 0:
            self._log_interval(trainer)

    def _log_interval(self, trainer: pl.Trainer) -> None:
        probe = self._probe
        if probe is None:
            return
        memory, timing, utilization = (
            self._tracker.take_interval(),
            self._timer.take_interval(),
            probe.take_utilization(),
        )
        if utilization is not None and utilization.process_memory_bytes is not None and memory.reserved_bytes:
            # What NVML sees beyond the allocator's reserve: the CUDA context and library workspaces.
            self._cuda_context_bytes = max(utilization.process_memory_bytes - memory.reserved_bytes, 0)
        scalars = interval_scalars(memory, timing, utilization, probe.host_rss_bytes())
        if trainer.world_size > 1:  # every rank reaches this at the same step: one gather per interval
            scalars = reduce_over_ranks(self._gather_rows(trainer, scalar_vector(scalars)))
        if not trainer.is_global_zero or not trainer.loggers:
            return
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=trainer.global_step)

    @staticmethod
    def _gather_rows(trainer: pl.Trainer, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (NaN for not measured), through the strategy's all_gather. A collective."""
        local = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local)
        rows: list[list[float]] = gathered.reshape(trainer.world_size, len(values)).cpu().tolist()
        return rows

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_advice_text(trainer, pl_module)

    @staticmethod
    def _tensorboard_writers(trainer: pl.Trainer) -> list[TensorBoardWriter]:
        """The SummaryWriters of the Trainer's TensorBoard loggers (``lightning``'s or ``pytorch_lightning``'s).

        None but on global rank zero.
        """
        if not trainer.is_global_zero:
            return []
        classic = sys.modules.get("pytorch_lightning.loggers")  # only when the user's code imported it
        writers: list[TensorBoardWriter] = []
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) or (
                classic is not None and isinstance(logger, classic.TensorBoardLogger)
            ):
                writers.append(logger.experiment)
        return writers

    def _write_advice_text(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The advice so far, as text in every TensorBoard logger (global rank zero)."""
        probe, device_info = self._probe, self._device_info
        writers = self._tensorboard_writers(trainer)
        if probe is None or device_info is None or not writers:
            return
        advice = advise(self._run_summary(probe, device_info), training_setup(trainer, pl_module))
        for writer in writers:
            write_advice(writer, advice, trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, gather_ranks=True)
        report = self.report
        if report is None or not trainer.is_global_zero:
            return
        for writer in self._tensorboard_writers(trainer):
            write_advice(writer, report.advice, trainer.global_step)
            write_figures(writer, report, trainer.global_step)
        if self.config.console_summary:
            print_summary(report)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Write the report of the run so far, and on CUDA out-of-memory this rank's diagnosis.

        Never raises, and runs no collective: the user's exception reaches them unchanged.
        """
        if self._attributor is not None:
            self._attributor.close()
            self._attributor = None
        if isinstance(exception, torch.cuda.OutOfMemoryError):
            try:
                self._diagnose_oom(trainer, pl_module, exception)
            except Exception as error:  # noqa: BLE001 -- raising here would replace the user's exception
                warnings.warn(f"VramMonitor: no OOM diagnosis: {error!r}", VramMonitorWarning, stacklevel=2)
        self._phase = None
        try:
            self._finish(trainer, pl_module, gather_ranks=False)  # no collective: other ranks may be gone
        except Exception as error:  # noqa: BLE001 -- raising here would replace the user's exception
            warnings.warn(f"VramMonitor: the report could not be written: {error!r}", VramMonitorWarning, stacklevel=2)

    def _diagnose_oom(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        probe, device_info, directory = self._probe, self._device_info, self._report_dir
        if probe is None or device_info is None or directory is None:
            return
        where = self._evaluating or (self._phase.value if self._phase is not None else "training")
        parameters, gradients, state = model_state_bytes(pl_module, trainer.optimizers, self._device)
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
        if self._recording_history:
            name = report_stem(SNAPSHOT_STEM, trainer.global_rank, trainer.world_size) + ".pickle"
            directory.mkdir(parents=True, exist_ok=True)
            snapshot = history.dump_snapshot(directory / name)
        self.oom_diagnosis = diagnose(
            error_text=str(exception),
            where=where,
            step=self._tracker.steps,
            rank=trainer.global_rank,
            model_state=Breakdown(parameters, gradients, state, sampled.activations if sampled else 0, None),
            last_reading=self._boundary,
            summary=self._run_summary(probe, device_info),
            setup=training_setup(trainer, pl_module),
            notes=tuple(notes),
            snapshot=snapshot,
        )
        path = write_diagnosis(self.oom_diagnosis, directory, trainer.world_size)
        print(f"VramMonitor (rank {trainer.global_rank}): {self.oom_diagnosis.headline()}; see {path}", file=sys.stderr)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._attributor is not None:
            self._attributor.close()
            self._attributor = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._recording_history:
            history.stop_recording()
            self._recording_history = False

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, gather_ranks: bool) -> None:
        probe, device_info = self._probe, self._device_info
        if probe is None or device_info is None:
            return
        peak = self._tracker.peak
        own = RankSummary(
            rank=trainer.global_rank,
            device_index=device_info.index,
            peak_bytes=peak.peak_bytes if peak is not None else None,
            steps=self._tracker.steps,
        )
        ranks: tuple[RankSummary, ...] = (own,)
        if gather_ranks and trainer.world_size > 1:
            ranks = tuple(map(_rank_from_row, enumerate(self._gather_rows(trainer, _rank_row(own)))))
        self.report = self._build_report(trainer, pl_module, probe, device_info, ranks)
        if trainer.is_global_zero and self._report_dir is not None:
            self.report_path = write_report_files(self.report, self._report_dir)

    def _run_summary(self, probe: Probe, device_info: DeviceInfo) -> RunSummary:
        tracker, timer = self._tracker, self._timer
        largest = tracker.largest_activation_attribution
        return RunSummary(
            device=device_info,
            peak=tracker.peak,
            phases=dict(tracker.phase_peaks),
            modules=largest.modules if largest is not None else (),
            batch_size=largest.batch_size if largest is not None else None,
            step_seconds_median=timer.median_step_seconds(),
            data_wait_fraction=timer.data_wait_fraction(),
            recent_data_wait_fraction=timer.recent_data_wait_fraction(),
            timed_steps=timer.timed_steps,
            gpu_utilization_mean=probe.mean_utilization_percent(),
            alloc_retries=tracker.alloc_retries,
            cuda_context_bytes=self._cuda_context_bytes,
            recovered_ooms=tracker.recovered_ooms,
            last_step=tracker.last_step,
        )

    def _build_report(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        probe: Probe,
        device_info: DeviceInfo,
        ranks: tuple[RankSummary, ...],
    ) -> Report:
        tracker = self._tracker
        summary = self._run_summary(probe, device_info)
        not_measured = probe.unavailable()
        if self._history_unavailable is not None:
            not_measured += (self._history_unavailable,)
        if self._compiled_note is not None:
            not_measured += (self._compiled_note,)
        if self._attribution_disabled is not None:
            not_measured += (self._attribution_disabled,)
        elif tracker.latest_attribution is None:
            not_measured += (
                NotMeasured(
                    "tensor-by-tensor attribution",
                    f"no training batch reached attribution_start_step={self.config.attribution_start_step}",
                ),
            )
        return Report(
            device=device_info,
            precision=str(trainer.precision),
            steps=tracker.steps,
            peak=tracker.peak,
            phases=summary.phases,
            modules=largest_savers(summary.modules)[: self.config.top_modules],
            timing=TimingSummary(
                step_seconds_median=summary.step_seconds_median,
                data_wait_fraction=summary.data_wait_fraction,
                gpu_utilization_mean=summary.gpu_utilization_mean,
            ),
            advice=advise(summary, training_setup(trainer, pl_module)),
            fit=fit_table(summary),
            batch_size=summary.batch_size,
            recovered_ooms=summary.recovered_ooms,
            recent_peaks=tuple(tracker.recent),
            evaluation=tuple(tracker.evaluation.values()),
            ranks=ranks,
            not_measured=not_measured,
        )


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
