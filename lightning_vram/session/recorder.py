"""The hot path: the device probe's allocator readings, folded by the tracker, and the timer.

Every training step calls :meth:`StepRecorder.start_step`, :meth:`~StepRecorder.boundary` (before backward, before
the optimizer step) and :meth:`~StepRecorder.end_step`: host-side counters only, no device synchronisation, each
part guarded by the run's :class:`~lightning_vram._guard.Guard`.

On CUDA, reading the allocator costs about 18 us (torch builds its whole statistics dictionary), resetting its peak
0.2 us. Most steps are read once: the peak reset at the start, one read at the end (the step's peak, allocated and
reserved). Some are read phase by phase, at every boundary (:meth:`StepRecorder.start_step` says which): the run's
first :data:`PHASE_READ_STEPS`, the sampled steps, the last step of each log interval and the step after one read
once that set a new run peak. A step read once credits its peak to the phase that peaked on the last step read phase
by phase (:meth:`~lightning_vram.measure.tracker.MemoryTracker.end_step_read_once`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lightning_vram._guard import Guard, Part
from lightning_vram.config import MonitorConfig
from lightning_vram.exceptions import warn
from lightning_vram.measure import history
from lightning_vram.measure.batch_shapes import ShapeRecorder
from lightning_vram.measure.probes import BlindProbe, CpuProbe, Probe, probe_for
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
SHAPES = Part.SHAPES
FORWARD = Phase.FORWARD
CPU_READ_ALLOCATOR = CpuProbe.read_allocator
"""The CPU's allocator read: it always returns ``None``; a probe that keeps it is not read on the hot path."""
PHASE_READ_STEPS = 10
"""The first steps of each run (a resumed one's too) read phase by phase: optimizer state appears on the first
optimizer step, the caching allocator fills, the first sampled step (``attribution_start_step``, 2 by default) falls
among them; after them, which phase peaks is settled for the steps read once."""


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
        self.shapes = ShapeRecorder()
        """Each batch tensor's size range and the run's largest batch."""
        self.probe: Probe | None = None
        """The open probe; ``None`` before :meth:`open` and after :meth:`close`."""
        self.device: DeviceInfo | None = None
        """The device the probe opened."""
        self.phase: Phase | None = None
        """The phase running now; ``None`` outside a training step."""
        self._reads = False  # whether the probe's reads can return anything (not the CPU's, always None)
        self._by_phase = True  # whether this step is read at every boundary (else once, at its end)
        self._phase_steps_left = PHASE_READ_STEPS  # the run's first steps, read phase by phase
        self._next_by_phase = False  # the step before set a new run peak, read once: read this one phase by phase

    def open(self, probe: Probe | None, device: torch.device, utilization_interval_seconds: float) -> None:
        """Open ``probe`` (default: the one that fits ``device``); one that fails warns and a blind one reads."""
        probe = probe or probe_for(device, utilization_interval_seconds, self._guard.owner)
        info = self._guard.call(Part.PROBE, probe.open, device)
        if info is None:  # the run goes on, read by a probe that reads nothing
            probe = BlindProbe()
            info = probe.open(device)
        self.probe, self.device = probe, info
        self._reads = not _never_reads(probe)
        self._phase_steps_left, self._next_by_phase = PHASE_READ_STEPS, False
        if info.type != "cuda":
            warn(
                f"{self._guard.owner}: the model trains on {device}, not a CUDA GPU: allocator peaks, reserved memory"
                " and GPU utilization are not measured; peaks are live tensors, counted on sampled steps."
            )

    def restore(self, tracker: MemoryTracker, timer: StepTimer) -> None:
        """Continue from a checkpoint's aggregates."""
        self.tracker, self.timer = tracker, timer

    @property
    def reads_allocator(self) -> bool:
        """Whether the allocator is read (a CUDA probe whose reads have not failed)."""
        return self._reads and self.probe is not None and ALLOCATOR not in self._guard.off

    def read(self) -> AllocatorReading | None:
        """The allocator's counters now (``None`` without an allocator, or once reading failed)."""
        probe = self.probe
        if probe is None:
            return None
        return self._guard.call(ALLOCATOR, probe.read_allocator, self._reset_peak)

    def observe_batch(self, step: int, batch: Any) -> bool:
        """Record the shapes of step ``step``'s batch. Returns whether it is the run's largest so far."""
        guard = self._guard
        if batch is None or SHAPES in guard.off:
            return False
        try:
            return self.shapes.observe(step, batch)
        except Exception as error:  # noqa: BLE001 -- the guard's own handling, inline on the hot path
            guard.fail(SHAPES, error)
            return False

    def start_step(self, ends_interval: bool = False) -> AllocatorReading | None:
        """A training step starts: time it, read the allocator, open its forward phase. Returns the reading.

        The step is read phase by phase (the reading returned) when ``ends_interval`` (it is the last of a log
        interval), among the run's first :data:`PHASE_READ_STEPS`, after a step read once that set a new run peak, or
        without peak resets (``reset_peak_stats=False``: each phase's lower bound needs its boundaries). Any other
        step only resets the peak (``None`` returned); :meth:`read_by_phase` turns it into one read phase by phase.

        The hot path runs each part in its own ``try`` and hands a failure to :meth:`Guard.fail
        <lightning_vram._guard.Guard.fail>`: what :meth:`Guard.call <lightning_vram._guard.Guard.call>` does, without
        its call per part.
        """
        guard = self._guard
        off = guard.off
        if TIMING not in off:
            try:
                self.timer.batch_started()
            except Exception as error:  # noqa: BLE001 -- the guard's own handling, inline on the hot path
                guard.fail(TIMING, error)
        left = self._phase_steps_left
        by_phase = ends_interval or left > 0 or self._next_by_phase or not self._reset_peak
        self._by_phase, self._next_by_phase = by_phase, False
        if left > 0:
            self._phase_steps_left = left - 1
        reading, probe = None, self.probe
        if self._reads and probe is not None and ALLOCATOR not in off:
            try:
                if by_phase:
                    reading = probe.read_allocator(self._reset_peak)
                else:
                    probe.reset_peak()
            except Exception as error:  # noqa: BLE001 -- as above
                guard.fail(ALLOCATOR, error)
        if TRACKER not in off:
            try:
                self.tracker.start_step(reading)
            except Exception as error:  # noqa: BLE001 -- as above
                guard.fail(TRACKER, error)
        self.phase = FORWARD
        return reading

    def read_by_phase(self) -> None:
        """Read the step begun as one read once phase by phase after all (it may be sampled): its start read now."""
        if self._by_phase or not self._reads:  # read phase by phase already, or nothing to read (the CPU)
            return
        self._by_phase = True
        reading = self.read()
        if self._guard.enabled(TRACKER):
            self._guard.call(TRACKER, self.tracker.start_step, reading)

    def boundary(self, label: Phase, next_phase: Phase | None) -> None:
        """End the segment since the last boundary as ``label``: one allocator read, folded by the tracker.

        Nothing is read on a step read once (:meth:`start_step`).
        """
        self.phase = next_phase
        probe = self.probe
        if not self._by_phase or not self._reads or probe is None:  # nothing to read, nothing to fold
            return
        guard = self._guard
        off = guard.off
        if ALLOCATOR in off:
            return  # the tracker folds nothing without a reading
        try:
            reading = probe.read_allocator(self._reset_peak)
        except Exception as error:  # noqa: BLE001 -- the guard's own handling, inline on the hot path
            guard.fail(ALLOCATOR, error)
            return
        if reading is not None and TRACKER not in off:
            try:
                self.tracker.close_phase(label, reading)
            except Exception as error:  # noqa: BLE001 -- as above
                guard.fail(TRACKER, error)

    def fold_step(self, attribution: Attribution | None) -> int:
        """Fold the step that ended (with its counts on a sampled step). Returns the steps so far."""
        tracker = self.tracker
        if TRACKER in self._guard.off:
            tracker.count_step()  # peaks are off, the step count still drives sampling and the report
            return tracker.steps
        try:
            tracker.end_step(attribution)
        except Exception as error:  # noqa: BLE001 -- the guard's own handling, inline on the hot path
            self._guard.fail(TRACKER, error)
        return tracker.steps

    def end_timing(self) -> None:
        """The step's time ends now (after whatever the step's end ran)."""
        guard = self._guard
        if TIMING not in guard.off:
            try:
                self.timer.batch_ended()
            except Exception as error:  # noqa: BLE001 -- the guard's own handling, inline on the hot path
                guard.fail(TIMING, error)

    def end_step(self, label: Phase) -> int:
        """An unsampled step ends: :meth:`boundary` (``label``), :meth:`fold_step` and :meth:`end_timing` in one call.

        A step read once is read now, its one reading folded (:meth:`~MemoryTracker.end_step_read_once`). Returns the
        steps so far.
        """
        if self._by_phase or not self._reads:
            self.boundary(label, None)
            steps = self.fold_step(None)
        else:
            self.phase = None
            steps = self._fold_read_once(label)
        self.end_timing()
        return steps

    def _fold_read_once(self, last: Phase) -> int:
        """Read the allocator once at the end of a step read once (which ended in ``last``) and fold it.

        Returns the steps so far.
        """
        guard, tracker, probe = self._guard, self.tracker, self.probe
        off = guard.off
        reading = None
        if probe is not None and ALLOCATOR not in off:
            try:
                reading = probe.read_allocator(self._reset_peak)
            except Exception as error:  # noqa: BLE001 -- the guard's own handling, inline on the hot path
                guard.fail(ALLOCATOR, error)
        if reading is None or TRACKER in off:
            return self.fold_step(None)  # nothing read (or peaks are off): the step still counts
        try:
            self._next_by_phase = tracker.end_step_read_once(reading, last)
        except Exception as error:  # noqa: BLE001 -- as above
            guard.fail(TRACKER, error)
        return tracker.steps

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
        self._reads = False
        if probe is not None:
            self._guard.call(Part.PROBE, probe.close)


def _never_reads(probe: Probe) -> bool:
    """Whether ``probe`` is a CPU probe whose ``read_allocator`` is the CPU's own (always ``None``, never raises)."""
    return (
        isinstance(probe, CpuProbe)
        and getattr(type(probe), "read_allocator", None) is CPU_READ_ALLOCATOR
        and "read_allocator" not in vars(probe)
    )


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
            warn(f"{self._guard.owner}: record_history is off: {reason}.")
            return
        self._guard.call(Part.HISTORY, history.start_recording, max_entries)
        self.recording = self._guard.enabled(Part.HISTORY)

    def stop(self) -> None:
        """Stop recording (safe when it was not)."""
        if self.recording:
            self.recording = False
            self._guard.call(Part.HISTORY, history.stop_recording)
