"""The evaluation loops of a run (validation, test, predict): each batch's allocator peak, kept per stage."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_vram.config import MonitorConfig
from lightning_vram.measure.tensors import batch_size_of, time_major
from lightning_vram.session.context import RunContext, model_device
from lightning_vram.session.recorder import StepRecorder


class EvaluationLoops:
    """Which evaluation loop runs now, and whether it is measured alone (outside a training run).

    Args:
        config: the monitor's settings (the probe and NVML's sampling interval, for a loop measured alone).
        context: the run's facts (its device is set here for a loop measured alone).
        recorder: the run's recorder: it reads the allocator and keeps each stage's highest batch peak.
    """

    def __init__(self, config: MonitorConfig, context: RunContext, recorder: StepRecorder) -> None:
        self._config, self._context, self._recorder = config, context, recorder
        self.stage: str | None = None
        """The loop running now (``"validation"``, ``"test"``, ``"predict"``); ``None`` outside one."""
        self.standalone = False
        """Whether the loop running now is measured alone: its probe was opened for it and closes with it."""
        self.batch_size: int | None = None
        """The size of the evaluation batch running now (its first tensor's first dimension); ``None`` where not
        told or without one: the batch to halve where it runs out of memory."""

    def start(self, stage: str, model: nn.Module | None) -> None:
        """The loop of ``stage`` starts; outside a run (no probe open) and with a ``model`` it is measured alone."""
        self.stage = stage
        recorder, context = self._recorder, self._context
        if recorder.probe is None and model is not None:
            context.device = model_device(model)
            recorder.open(self._config.probe, context.device, self._config.utilization_interval_seconds)
            self.standalone = True

    def batch_start(self, batch: Any = None) -> None:
        """An evaluation batch starts (``batch``, where given, is read for its size: shapes only)."""
        if self.stage is not None:
            self.batch_size = batch_size_of(batch) if batch is not None and time_major(batch) is None else None
            self._recorder.evaluation_batch_start()

    def batch_end(self) -> None:
        """The evaluation batch ends: its allocator peak is kept if it is its stage's highest."""
        if self.stage is not None:
            self._recorder.evaluation_batch_end(self.stage)

    def end(self) -> str | None:
        """The loop ends. Returns its stage when it was measured alone (its probe must close now), else ``None``."""
        stage, self.stage = self.stage, None
        if not self.standalone or stage is None:
            return None
        self.standalone = False
        return stage
