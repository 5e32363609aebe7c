"""Per-step phase peaks and bounded aggregates over the run.

Memory held by the tracker does not grow with the run: maxima, the last step's phases, the sampled
attributions it needs, evaluation peaks per stage, and a fixed-size window of recent step peaks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from lightning_vram.records import AllocatorReading, Attribution, Breakdown, EvaluationPeak, Phase, PhasePeak
from lightning_vram.state import (
    attribution_from_state,
    attribution_state,
    phase_peak_from_state,
    phase_peak_state,
)


def phase_peak_bytes(start: AllocatorReading, end: AllocatorReading, peak_was_reset: bool) -> int:
    """The allocator's peak during a phase that began at ``start`` and ended at ``end``, in bytes.

    With the peak reset at every boundary, the end reading's peak is exactly the phase's peak. Left
    untouched, the process-wide peak is exact when it rose during the phase; otherwise the phase
    stayed below an older peak and the higher of its two boundary values is a lower bound.

    >>> a = AllocatorReading(100, 200, 150, 0)
    >>> phase_peak_bytes(a, AllocatorReading(120, 200, 180, 0), peak_was_reset=True)
    180
    >>> phase_peak_bytes(a, AllocatorReading(120, 200, 150, 0), peak_was_reset=False)
    120
    """
    if peak_was_reset or end.peak_allocated_bytes > start.peak_allocated_bytes:
        return end.peak_allocated_bytes
    return max(start.allocated_bytes, end.allocated_bytes)


@dataclass(frozen=True)
class MeasuredPhase:
    """What the allocator saw during one phase: its peak, and the counters at its end, in bytes."""

    peak_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    alloc_retries: int


@dataclass(frozen=True)
class StepPoint:
    """The peak of one step, for charts of memory over steps."""

    step: int
    peak_bytes: int


@dataclass(frozen=True)
class IntervalMemory:
    """Memory over one log interval: the counters at its end and its highest peaks, in bytes."""

    allocated_bytes: int | None
    reserved_bytes: int | None
    peak: PhasePeak | None
    phase_peak_bytes: dict[Phase, int]


class MemoryTracker:
    """Folds each step's phase peaks into run maxima, the last step, evaluation peaks and a recent window."""

    def __init__(self, recent_steps: int) -> None:
        self.steps = 0
        self.peak: PhasePeak | None = None
        self.phase_peaks: dict[Phase, PhasePeak] = {}
        self.recent: deque[StepPoint] = deque(maxlen=recent_steps)
        self.latest_attribution: Attribution | None = None
        self.largest_activation_attribution: Attribution | None = None
        self.alloc_retries: int | None = None
        self.last_step: tuple[PhasePeak, ...] = ()
        self.recovered_ooms: int | None = None
        self.evaluation: dict[str, EvaluationPeak] = {}
        self._ooms_seen: int | None = None
        self._interval_end: MeasuredPhase | None = None
        self._interval_peak: PhasePeak | None = None
        self._interval_phase_peaks: dict[Phase, int] = {}

    def update(self, step: int, measured: dict[Phase, MeasuredPhase], attribution: Attribution | None) -> None:
        """Fold one finished step: allocator phases (CUDA) and, on sampled steps, the counted parts."""
        self.steps += 1
        if attribution is not None:
            self._remember(attribution)
        peaks = [peak for phase in Phase if (peak := self._phase_peak(step, phase, measured, attribution))]
        if not peaks:
            return
        for phase_measure in measured.values():
            self._interval_end = phase_measure
            self.alloc_retries = phase_measure.alloc_retries
        self.last_step = tuple(peaks)
        step_peak = max(peaks, key=lambda peak: peak.peak_bytes)
        self.recent.append(StepPoint(step, step_peak.peak_bytes))
        if self.peak is None or step_peak.peak_bytes > self.peak.peak_bytes:
            self.peak = step_peak
        if self._interval_peak is None or step_peak.peak_bytes > self._interval_peak.peak_bytes:
            self._interval_peak = step_peak
        for peak in peaks:
            best = self.phase_peaks.get(peak.phase)
            if best is None or peak.peak_bytes > best.peak_bytes:
                self.phase_peaks[peak.phase] = peak
            self._interval_phase_peaks[peak.phase] = max(self._interval_phase_peaks.get(peak.phase, 0), peak.peak_bytes)

    def record_evaluation(self, peak: EvaluationPeak) -> None:
        """One evaluation batch's peak; each stage keeps its highest."""
        known = self.evaluation.get(peak.stage)
        if known is None or peak.peak_bytes > known.peak_bytes:
            self.evaluation[peak.stage] = peak

    def observe_ooms(self, count: int) -> None:
        """The allocator's out-of-memory count at a boundary: a rise since the last one is an OOM training survived."""
        if self._ooms_seen is None:
            self.recovered_ooms = 0
        elif count > self._ooms_seen:
            self.recovered_ooms = (self.recovered_ooms or 0) + count - self._ooms_seen
        self._ooms_seen = count

    def _phase_peak(
        self, step: int, phase: Phase, measured: dict[Phase, MeasuredPhase], attribution: Attribution | None
    ) -> PhasePeak | None:
        counted = attribution.phases.get(phase) if attribution is not None else None
        allocator = measured.get(phase)
        if allocator is None:
            if counted is None:
                return None
            return PhasePeak(step, phase, counted.counted_bytes, None, counted)
        return PhasePeak(
            step,
            phase,
            allocator.peak_bytes,
            allocator.reserved_bytes,
            self._attribute(phase, allocator.peak_bytes, counted),
        )

    def _attribute(self, phase: Phase, peak_bytes: int, counted: Breakdown | None) -> Breakdown | None:
        """Counted parts for a measured peak: this step's when sampled, else the latest sample's."""
        if counted is None and self.latest_attribution is not None:
            counted = self.latest_attribution.phases.get(phase)
        return counted.with_measured_peak(peak_bytes) if counted is not None else None

    def _remember(self, attribution: Attribution) -> None:
        first = self.latest_attribution is None
        self.latest_attribution = attribution
        largest = self.largest_activation_attribution
        if largest is None or _activation_bytes(attribution) > _activation_bytes(largest):
            self.largest_activation_attribution = attribution
        if first:
            # Steps measured before the first sample get its counts: model state is the same size after warm-up.
            self.peak = self._with_breakdown(self.peak)
            self.phase_peaks = {
                phase: attributed
                for phase, peak in self.phase_peaks.items()
                if (attributed := self._with_breakdown(peak)) is not None
            }

    def _with_breakdown(self, peak: PhasePeak | None) -> PhasePeak | None:
        if peak is None or peak.breakdown is not None:
            return peak
        return replace(peak, breakdown=self._attribute(peak.phase, peak.peak_bytes, None))

    def state_dict(self) -> dict[str, Any]:
        """The run aggregates as plain data (the current interval and the OOM counter's baseline are not kept)."""
        return {
            "steps": self.steps,
            "peak": phase_peak_state(self.peak) if self.peak is not None else None,
            "phase_peaks": [phase_peak_state(peak) for peak in self.phase_peaks.values()],
            "recent": [[point.step, point.peak_bytes] for point in self.recent],
            "latest_attribution": attribution_state(self.latest_attribution),
            "largest_activation_attribution": attribution_state(self.largest_activation_attribution),
            "alloc_retries": self.alloc_retries,
            "last_step": [phase_peak_state(peak) for peak in self.last_step],
            "recovered_ooms": self.recovered_ooms,
            "evaluation": [
                [peak.stage, peak.peak_bytes, peak.reserved_bytes, peak.after_step] for peak in self.evaluation.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run that :meth:`state_dict` saved."""
        self.steps = state["steps"]
        self.peak = phase_peak_from_state(state["peak"]) if state["peak"] is not None else None
        self.phase_peaks = {peak.phase: peak for peak in map(phase_peak_from_state, state["phase_peaks"])}
        self.recent.clear()
        self.recent.extend(StepPoint(step, peak_bytes) for step, peak_bytes in state["recent"])
        self.latest_attribution = attribution_from_state(state["latest_attribution"])
        self.largest_activation_attribution = attribution_from_state(state["largest_activation_attribution"])
        self.alloc_retries = state["alloc_retries"]
        self.last_step = tuple(phase_peak_from_state(peak) for peak in state["last_step"])
        self.recovered_ooms = state["recovered_ooms"]
        self.evaluation = {row[0]: EvaluationPeak(*row) for row in state["evaluation"]}

    def take_interval(self) -> IntervalMemory:
        """Memory since the last call, then start a new interval."""
        end = self._interval_end
        interval = IntervalMemory(
            allocated_bytes=end.allocated_bytes if end is not None else None,
            reserved_bytes=end.reserved_bytes if end is not None else None,
            peak=self._interval_peak,
            phase_peak_bytes=dict(self._interval_phase_peaks),
        )
        self._interval_peak = None
        self._interval_phase_peaks.clear()
        return interval


def _activation_bytes(attribution: Attribution) -> int:
    forward = attribution.phases.get(Phase.FORWARD)
    return forward.activations if forward is not None else 0
