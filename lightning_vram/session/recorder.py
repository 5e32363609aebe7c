"""The hot path: the device probe's allocator readings at every phase boundary, folded by the tracker, and the timer.

Every training step calls :meth:`StepRecorder.start_step`, :meth:`~StepRecorder.boundary` (before backward, before
the optimizer step) and :meth:`~StepRecorder.end_step`: host-side counters only, no device synchronisation, each
part guarded by the run's :class:`~lightning_vram._guard.Guard`.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from lightning_vram._guard import Guard, Part
from lightning_vram.config import MonitorConfig
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.measure import history
from lightning_vram.measure.probes import BlindProbe, Probe, probe_for
from lightning_vram.measure.timing import StepTimer
from lightning_vram.measure.tracker import MemoryTracker
from lightning_vram.records import (
    AllocatorReading,
    Attribution,
    DeviceInfo,
    IntervalMemory,
    IntervalTiming,
    NotMeasured,
    Phase,
    UtilizationReading,
)

ALLOCATOR, TRACKER, TIMING, UTILIZATION = Part.ALLOCATOR, Part.TRACKER, Part.TIMING, Part.UTILIZATION
FORWARD = Phase.FORWARD


class Interval(NamedTuple):
    """What a log interval measured: memory, timing, NVML's utilization and the host's RSS (bytes)."""

    memory: IntervalMemory
    timing: IntervalTiming
    utilization: UtilizationReading | None
    host_rss_bytes: int | None


class StepRecorder:
    """One run's device probe, phase peaks (:class:`MemoryTracker`) and step times (:class:`StepTimer`).

    Args:
        config: the monitor's settings (``recent_steps``, ``reset_peak_stats``, ``clock``).
        guard: the run's guard; every read and fold goes through it.
    """

    def __init__(self, config: MonitorConfig, guard: Guard) -> None:
        self._guard = guard
        self._reset_peak = config.reset_peak_stats
        self.tracker = MemoryTracker(config.recent_steps, config.reset_peak_stats)
        self.timer = StepTimer(config.recent_steps, config.clock)
        self.probe: Probe | None = None
        """The open probe; ``None`` before :meth:`open` and after :meth:`close`."""
        self.device: DeviceInfo | None = None
        """The device the probe opened."""
        self.phase: Phase | None = None
        """The phase running now; ``None`` outside a training step."""

    def open(self, probe: Probe | None, device: torch.device, utilization_interval_seconds: float) -> None:
        """Open ``probe`` (default: the one that fits ``device``); one that fails warns and a blind one reads."""
        probe = probe or probe_for(device, utilization_interval_seconds)
        info = self._guard.call(Part.PROBE, probe.open, device)
        if info is None:  # the run goes on, read by a probe that reads nothing
            probe = BlindProbe()
            info = probe.open(device)
        self.probe, self.device = probe, info
        if info.type != "cuda":
            warnings.warn(
                f"VramMonitor: the model trains on {device}, not a CUDA GPU: allocator peaks, 'other' memory"
                " and GPU utilization are not measured; tensors are still counted.",
                VramMonitorWarning,
                stacklevel=4,
            )

    def restore(self, tracker: MemoryTracker, timer: StepTimer) -> None:
        """Continue from a checkpoint's aggregates."""
        self.tracker, self.timer = tracker, timer

    def read(self) -> AllocatorReading | None:
        """The allocator's counters now (``None`` without an allocator, or once reading failed)."""
        probe = self.probe
        if probe is None:
            return None
        return self._guard.call(ALLOCATOR, probe.read_allocator, self._reset_peak)

    def start_step(self) -> AllocatorReading | None:
        """A training step starts: time it, read the allocator, open its forward phase. Returns the reading."""
        guard = self._guard
        guard.call(TIMING, self.timer.batch_started)
        probe = self.probe
        reading = guard.call(ALLOCATOR, probe.read_allocator, self._reset_peak) if probe is not None else None
        guard.call(TRACKER, self.tracker.start_step, reading)
        self.phase = FORWARD
        return reading

    def boundary(self, label: Phase, next_phase: Phase | None) -> None:
        """End the segment since the last boundary as ``label``: one allocator read, folded by the tracker."""
        guard, probe = self._guard, self.probe
        reading = guard.call(ALLOCATOR, probe.read_allocator, self._reset_peak) if probe is not None else None
        guard.call(TRACKER, self.tracker.close_phase, label, reading)
        self.phase = next_phase

    def fold_step(self, attribution: Attribution | None) -> int:
        """Fold the step that ended (with its counts on a sampled step). Returns the steps so far."""
        guard, tracker = self._guard, self.tracker
        if guard.enabled(TRACKER):
            guard.call(TRACKER, tracker.end_step, attribution)
        else:
            tracker.count_step()  # peaks are off, the step count still drives sampling and the report
        return tracker.steps

    def end_timing(self) -> None:
        """The step's time ends now (after whatever the step's end ran)."""
        self._guard.call(TIMING, self.timer.batch_ended)

    def take_interval(self) -> Interval:
        """What the log interval since the last call measured, then start a new one."""
        probe, utilization, host_rss = self.probe, None, None
        if probe is not None:
            readings = self._guard.call(UTILIZATION, lambda: (probe.take_utilization(), probe.host_rss_bytes()))
            utilization, host_rss = readings or (None, None)
        return Interval(self.tracker.take_interval(), self.timer.take_interval(), utilization, host_rss)

    def mean_utilization_percent(self) -> float | None:
        """The run's mean GPU utilization (percent) as NVML sampled it; ``None`` where not measured."""
        probe = self.probe
        return None if probe is None else self._guard.call(UTILIZATION, probe.mean_utilization_percent)

    def unavailable(self) -> list[NotMeasured]:
        """What the probe could not measure on this device."""
        probe = self.probe
        return [] if probe is None else list(self._guard.call(Part.PROBE, probe.unavailable) or ())

    def evaluation_batch_start(self) -> None:
        """An evaluation batch starts: read the allocator."""
        if self._guard.enabled(TRACKER):
            self.tracker.start_evaluation_batch(self.read())

    def evaluation_batch_end(self, stage: str) -> None:
        """The evaluation batch of ``stage`` ends: its peak is kept if it is its stage's highest."""
        if self._guard.enabled(TRACKER):
            self.tracker.end_evaluation_batch(stage, self.read())

    def close(self) -> None:
        """Close the probe (its background thread must stop, whatever failed before)."""
        probe, self.probe = self.probe, None
        if probe is not None:
            self._guard.call(Part.PROBE, probe.close)


class AllocatorHistory:
    """The CUDA allocator's history (``record_history=True``): started with the run, stopped when it ends."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self.recording = False
        """Whether the history is being recorded now."""
        self.note: NotMeasured | None = None
        """Why it is not recorded, where it cannot be."""

    def start(self, device: torch.device, max_entries: int) -> None:
        """Start recording up to ``max_entries`` events; where it cannot be, warn once and say why in :attr:`note`."""
        reason = history.unavailable_reason() if device.type == "cuda" else "training does not run on CUDA"
        if reason is not None:
            self.note = NotMeasured("allocator history (record_history=True)", reason)
            warnings.warn(f"VramMonitor: record_history is off: {reason}.", VramMonitorWarning, stacklevel=4)
            return
        self._guard.call(Part.HISTORY, history.start_recording, max_entries)
        self.recording = self._guard.enabled(Part.HISTORY)

    def stop(self) -> None:
        """Stop recording (safe when it was not)."""
        if self.recording:
            self.recording = False
            self._guard.call(Part.HISTORY, history.stop_recording)
