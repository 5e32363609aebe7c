"""``VramMonitor``: the Lightning callback. Glue only: each hook forwards to a :class:`~lightning_vram.VramSession`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.utils.hooks import RemovableHandle
from typing_extensions import Unpack, override

from lightning_vram._handback import Handback, HandedBack
from lightning_vram._lightning import (
    log_interval,
    logging_step,
    report_dir,
    strategy_barrier,
    strategy_gather,
    trainer_callbacks,
    trainer_publishers,
    trainer_setup,
)
from lightning_vram.config import MonitorOptions, check_option_names
from lightning_vram.exceptions import MONITOR, warn
from lightning_vram.measure.live import apart_from_function_modes as _apart
from lightning_vram.records import EvaluationPeak, OomDiagnosis, Report
from lightning_vram.render.scalars import chart_scalars
from lightning_vram.session import VramSession


class VramMonitor(Callback):
    """Where GPU memory goes during training, phase by phase, and how busy the GPU is.

    Every training step, the allocator's peak is read at Lightning's phase boundaries (forward,
    backward, optimizer step) from host-side counters, without synchronising the device. On sampled
    steps the tensors are counted one by one: parameters, gradients, optimizer state and the
    activations each module saves for backward. Scalars go to every logger of the Trainer every
    ``log_every_n_steps``, at the step Lightning's own ``self.log`` uses; each logger also gets what it can hold of
    the figures, the advice, the report files, the advice ids as tags and the peak (see
    :func:`~lightning_vram.publisher_for`). After fit, :attr:`report` holds the
    :class:`~lightning_vram.records.Report` and ``vram_report.json`` (with ``.md`` and ``.html``) is written to the
    first logger's own run folder: the Trainer's ``log_dir`` for TensorBoard and CSV, the run's files folder for W&B,
    the run's artifact folder for MLflow with a local store, ``<offline dir>/vram_<experiment key>`` for Comet
    (``default_root_dir`` without a logger).

    Args:
        **options: the monitor's options, documented in :class:`~lightning_vram.config.MonitorOptions`.

    Raises:
        TypeError, ValueError: an option is not what it must be (the message names it, what it must be and what it
            got).
    """

    def __init__(self, **options: Unpack[MonitorOptions]) -> None:
        if "log_dir" in options:  # VramSession's own argument: the callback writes into the Trainer's log dir
            raise TypeError(
                "VramMonitor got an unexpected keyword argument 'log_dir': it writes to the Trainer's log_dir"
            )
        check_option_names("VramMonitor", options)
        self.session = VramSession(**options)
        """The measuring session every hook forwards to."""
        self.session._owner = MONITOR  # its warnings name the object the user made
        self.config = self.session.config
        config = self.config
        self._state_key = self._generate_state_key(
            attribution_start_step=config.attribution_start_step,
            attribution_every_n_steps=config.attribution_every_n_steps,
            log_every_n_steps=config.log_every_n_steps,
            reset_peak_stats=config.reset_peak_stats,
            top_modules=config.top_modules,
        )
        self._state_loaded = False
        self._logs = True
        self._handback = Handback(self)
        self._handed_back: HandedBack | None = None
        """Rank zero's report, after a fit that ran in processes Lightning spawned (``ddp_spawn``)."""
        self._manual = False  # whether the module trains under manual optimization (read as training starts)
        self._update_hooks: list[RemovableHandle] = []  # torch's step post-hooks on the optimizers (manual only)

    def _received(self) -> HandedBack | None:
        self._handed_back = self._handback.receive() or self._handed_back
        return self._handed_back

    @property
    def report(self) -> Report | None:
        """The report of the last fit, set when training ends (also when it ends by an exception).

        After a fit in spawned processes (``ddp_spawn``), rank zero's report, read back from its JSON form.
        """
        handed_back = self._received()
        return handed_back.report if handed_back is not None else self.session.report

    @property
    def report_path(self) -> Path | str | None:
        """Where ``vram_report.json`` was written, on global rank zero: a ``Path``, or a URL for a remote log dir."""
        handed_back = self._received()
        return handed_back.report_path if handed_back is not None else self.session.report_path

    @property
    def oom_diagnosis(self) -> OomDiagnosis | None:
        """The diagnosis of this rank when fit ended with a CUDA out-of-memory error."""
        return self.session.oom_diagnosis

    @property
    def evaluation_peaks(self) -> dict[str, EvaluationPeak]:
        """The highest evaluation-batch peak of each stage (validation, test, predict) last measured (CUDA)."""
        return self.session.evaluation_peaks

    @property
    @override
    @_apart
    def state_key(self) -> str:
        # Two monitors in one Trainer keep apart in the checkpoint when their settings differ. Lightning reads the key
        # on every hook it calls (to name the profiler's span): built once, from the frozen settings.
        return self._state_key

    @override
    @_apart
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # With several monitors, the first logs and writes as usual; each other one writes its files to a folder
        # of its own and leaves the loggers alone (the same scalar names would collide).
        self._handed_back = None  # a fit in this process: its own report from now on
        order = [callback for callback in trainer_callbacks(trainer) if isinstance(callback, VramMonitor)].index(self)
        self._logs = order == 0
        publishers = trainer_publishers(trainer)
        self.session.log_dir = report_dir(trainer, publishers, order)
        self.session.start(
            pl_module,
            lambda: trainer.optimizers,
            device=pl_module.device,
            setup=lambda: trainer_setup(trainer, pl_module),
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            gather=strategy_gather(trainer),
            barrier=strategy_barrier(trainer),
            publishers=publishers if self._logs else (),
            default_log_every_n_steps=log_interval(trainer),
            wrapper=lambda: trainer.strategy.model,
        )

    @override
    @_apart
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch_updates(trainer, pl_module)
        if trainer.ckpt_path is not None and not self._state_loaded:
            warn(
                f"VramMonitor: the checkpoint {trainer.ckpt_path} carries no state of this monitor (written without"
                " it, or with other settings); the report covers only the run since the resume."
            )

    def _watch_updates(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under manual optimization, hear where each backward pass and each optimizer's update returns.

        Lightning calls ``on_after_backward`` from ``manual_backward``; no Lightning hook follows an update, so each
        optimizer gets torch's public step post-hook (held by the optimizer outside its state: its ``state_dict``
        and pickles do not carry it), removed when training ends. Under automatic optimization the update runs until
        the batch ends, and neither is needed.
        """
        self._unwatch_updates()
        self._manual = not pl_module.automatic_optimization
        if self._manual:
            self._update_hooks = [
                optimizer.register_step_post_hook(self._updated)
                for optimizer in trainer.optimizers
                if isinstance(optimizer, torch.optim.Optimizer)
            ]

    def _unwatch_updates(self) -> None:
        hooks, self._update_hooks = self._update_hooks, []
        for hook in hooks:
            hook.remove()

    @_apart
    def _updated(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.session.after_optimizer_step()

    @override
    @_apart
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._manual:
            self.session.after_backward()

    @override
    @_apart
    def state_dict(self) -> dict[str, Any]:
        """The run's aggregates, so that the report after a resume covers the whole run."""
        return self.session.state_dict()

    @override
    @_apart
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start for most strategies (the session keeps the state until
        # the run starts), and after it for those that restore after setup (FSDP, DeepSpeed).
        self._state_loaded = True
        self.session.load_state_dict(state_dict)

    @override
    @_apart
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.break_continuity()

    @override
    @_apart
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.session.batch_start(batch)

    @override
    @_apart
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.session.before_backward()

    @override
    @_apart
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.session.before_optimizer_step()

    @override
    @_apart
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        self.session.batch_end(logging_step(trainer))  # the session publishes the scalars to the loggers

    @override
    @_apart
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.epoch_end(logging_step(trainer))

    @override
    @_apart
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # With several ranks, the others wait at the barrier while rank zero writes the files.
        self._unwatch_updates()
        self.session.finish(step=logging_step(trainer))

    @override
    @_apart
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning skips on_train_end when no training batch can run (max_epochs=0, limit_train_batches=0).
        self.session.finish(step=logging_step(trainer))

    @override
    @_apart
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Write the report of the run so far, and on CUDA out-of-memory this rank's diagnosis. Never raises."""
        self._unwatch_updates()
        self.session.fail(exception)

    @override
    @_apart
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwatch_updates()
        self.session.close()
        if self._handback.in_a_copy() and trainer.is_global_zero and self.session.report is not None:
            self._handback.send(self.session.report, self.session.report_path)  # ddp_spawn: to the user's monitor

    # Evaluation: validation inside fit is recorded beside training; a standalone validate/test/predict alone.

    def _end_evaluation(self, trainer: pl.Trainer) -> None:
        peak = self.session.end_evaluation()
        if peak is None or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(
                chart_scalars({f"vram/evaluation/{peak.stage}_peak_bytes": float(peak.peak_bytes)}),
                logging_step(trainer),
            )
        if self.config.console_summary:
            print(VramSession.evaluation_line(peak, trainer.strategy.root_device))

    @override
    @_apart
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.break_continuity()
        self.session.start_evaluation("validation", pl_module)

    @override
    @_apart
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    @_apart
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.start_evaluation("test", pl_module)

    @override
    @_apart
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    @_apart
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.start_evaluation("predict", pl_module)

    @override
    @_apart
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    @_apart
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.session.evaluation_batch_start(batch)

    @override
    @_apart
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.session.evaluation_batch_end()

    # The same forwarding for every evaluation loop (the signatures are the same).
    on_test_batch_start = on_validation_batch_start
    on_predict_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end
