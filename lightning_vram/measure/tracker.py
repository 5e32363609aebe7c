"""Per-step phase peaks folded into bounded aggregates over the run.

The hot path is plain integers: each phase boundary computes the allocator's peak since the last one and keeps
it in a reused slot; a step's end compares integers with the run's, the phase's and the interval's best and builds
a :class:`~lightning_vram.records.PhasePeak` only when one of them is beaten. A step read once, at its end
(:meth:`MemoryTracker.end_step_read_once`), credits its peak to the phase that peaked on the last step read phase by
phase; a record so credited gives way to a step read phase by phase that reaches the same bytes. Memory does not
grow with the run: maxima, the last step, the sampled attributions it needs, evaluation peaks per stage, and a
fixed-size window of recent step peaks.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning_vram.records import (
    AllocatorReading,
    Attribution,
    Breakdown,
    EvaluationPeak,
    IntervalMemory,
    Phase,
    PhasePeak,
    StepPoint,
)
from lightning_vram.records.json_reader import Reader
from lightning_vram.records.measured_json import (
    attribution_from_dict,
    attribution_to_dict,
    evaluation_from_dict,
    evaluation_to_dict,
    optional_phase_peak_from_dict,
    phase_peak_from_dict,
    phase_peak_to_dict,
    step_pair_from_list,
)

PHASES = tuple(Phase)
"""Phases in step order; a phase's index in it names its slot."""
SLOT = {phase: index for index, phase in enumerate(PHASES)}
"""A phase's slot: its index in :data:`PHASES`."""
UNSET = -1
"""A slot no boundary wrote this step."""
NO_COUNTS: dict[Phase, Breakdown] = {}
"""The counted parts of a step before any sampled step (never written to)."""


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


class MemoryTracker:
    """Phase peaks of every step, from allocator readings at the boundaries and the counts of sampled steps.

    Call :meth:`start_step` with the reading at batch start, :meth:`close_phase` at each later boundary (a phase
    met twice in a step, as under manual optimization, keeps its highest peak), and :meth:`end_step` once the step
    is over. Evaluation batches go through :meth:`start_evaluation_batch` and :meth:`end_evaluation_batch`.

    Args:
        recent_steps: how many recent step peaks are kept.
        peak_was_reset: whether the probe resets the allocator's peak at every read (see :func:`phase_peak_bytes`).
    """

    def __init__(self, recent_steps: int, peak_was_reset: bool) -> None:
        self._reset = peak_was_reset
        self.steps = 0
        """Training steps (batches) ended so far (over the whole run, a resume included)."""
        self.optimizer_steps: int | None = 0
        """Optimizer steps begun so far (``before_optimizer_step`` calls, a resume included): one per accumulation
        window, one per ``opt.step()`` under manual optimization; ``None``: not counted (resumed from a state that
        did not count them)."""
        self._recent: deque[tuple[int, int]] = deque(maxlen=recent_steps)
        self.latest_attribution: Attribution | None = None
        self.largest_activation_attribution: Attribution | None = None
        self.alloc_retries: int | None = None
        self.recovered_ooms: int | None = None
        self.evaluation: dict[str, EvaluationPeak] = {}
        self._ooms_seen: int | None = None
        self._boundary: AllocatorReading | None = None
        self._evaluation_start: AllocatorReading | None = None
        # Slots per phase: [peak bytes, reserved bytes at the phase's end]; this step's and the last step's.
        self._current = [[UNSET, 0] for _ in PHASES]
        self._last = [[UNSET, 0] for _ in PHASES]
        self._last_step_index = UNSET
        self._last_counted: dict[Phase, Breakdown] = {}
        # Run and phase bests as integers (compared every step) beside the records built when they are beaten;
        # whether each record's phase was credited (a step read once) rather than read.
        self._peak_bytes = UNSET
        self._peak: PhasePeak | None = None
        self._peak_credited = False
        self._phase_best = [UNSET] * len(PHASES)
        self._phase_credited = [False] * len(PHASES)
        self._phase_peaks: dict[Phase, PhasePeak] = {}
        self._peak_phase = 0  # the slot of the phase that peaked on the last step read phase by phase
        # The interval: its best step peak (step, phase index, bytes, reserved, counted) and each phase's best.
        self._interval_best: tuple[int, int, int, int | None, Breakdown | None] | None = None
        self._interval_phase_best = [UNSET] * len(PHASES)
        self._interval_allocated: int | None = None
        self._interval_reserved: int | None = None

    @property
    def boundary(self) -> AllocatorReading | None:
        """The allocator's last reading at a phase boundary (``None`` on a device without allocator counters)."""
        return self._boundary

    def start_step(self, reading: AllocatorReading | None) -> None:
        """A training step starts; ``reading`` is the allocator now (``None`` where there is none)."""
        current = self._current
        for slot in current:
            slot[0] = UNSET
        self._boundary = reading
        if reading is not None:
            self._observe(reading)  # once a step: close_phase, three times, has it inline

    def close_phase(self, phase: Phase, reading: AllocatorReading | None) -> None:
        """The segment since the last boundary ran ``phase``; ``reading`` is the allocator at its end."""
        start = self._boundary
        if reading is None or start is None:
            return
        allocated, reserved, peak, retries, count = reading  # one unpacking: the hot path
        if not (self._reset or peak > start.peak_allocated_bytes):
            peak = max(start.allocated_bytes, allocated)
        slot = self._current[SLOT[phase]]
        if peak > slot[0]:
            slot[0] = peak
        slot[1] = reserved
        self._boundary = reading
        # _observe, inline
        self.alloc_retries = retries
        self._interval_allocated = allocated
        self._interval_reserved = reserved
        seen = self._ooms_seen
        if seen is None:
            self.recovered_ooms = 0
        elif count > seen:
            self.recovered_ooms = (self.recovered_ooms or 0) + count - seen
        self._ooms_seen = count

    def _observe(self, reading: AllocatorReading) -> None:
        self.alloc_retries = reading.alloc_retries
        self._interval_allocated = reading.allocated_bytes
        self._interval_reserved = reading.reserved_bytes
        count, seen = reading.ooms, self._ooms_seen
        if seen is None:
            self.recovered_ooms = 0
        elif count > seen:
            self.recovered_ooms = (self.recovered_ooms or 0) + count - seen
        self._ooms_seen = count

    def count_step(self) -> None:
        """A step ended that is not folded (the tracker failed): it still counts."""
        self.steps += 1

    def count_optimizer_step(self) -> None:
        """An optimizer is about to step (each call counts, as Lightning's ``global_step`` does)."""
        counted = self.optimizer_steps
        if counted is not None:
            self.optimizer_steps = counted + 1

    def end_step_read_once(self, reading: AllocatorReading, last: Phase) -> bool:
        """Fold a step read once, at its end, its peak reset at its start: ``reading``'s peak is the step's peak.

        Which phase held it was not read: it is credited to the phase that peaked on the last step read phase by
        phase, or to ``last``, the phase the step ended in, where it ended before that one (a batch that accumulates
        gradients runs no optimizer step). Returns whether it set a new run peak (the caller reads the next step
        phase by phase; that step's record replaces the credited one where it reaches the same bytes).
        """
        self._observe(reading)
        slot = self._current[min(self._peak_phase, SLOT[last])]
        slot[0] = reading.peak_allocated_bytes
        slot[1] = reading.reserved_bytes
        best = self._peak_bytes
        self._fold(None, credited=True)
        return self._peak_bytes > best

    def end_step(self, attribution: Attribution | None) -> None:
        """Fold the step that ends now: its allocator peaks (CUDA) and, on sampled steps, its counted parts."""
        self._fold(attribution, credited=False)

    def _fold(self, attribution: Attribution | None, credited: bool) -> None:
        """Fold this step's slots; ``credited``: its one peak sits in the slot of a phase it was credited to."""
        step = self.steps
        self.steps += 1
        if attribution is not None:
            self._remember(attribution)
        latest = self.latest_attribution
        counted = (latest.phases if latest is not None else None) or NO_COUNTS
        place = attribution.micro_batch if attribution is not None else None  # a sampled step's, in its window
        current = self._current
        phase_best, interval_phase_best, phase_credited = (
            self._phase_best,
            self._interval_phase_best,
            self._phase_credited,
        )
        step_bytes, step_phase = UNSET, 0
        for index, slot in enumerate(current):
            peak = slot[0]
            if peak == UNSET:
                if attribution is None or PHASES[index] not in attribution.phases:
                    continue
                peak = slot[0] = attribution.phases[PHASES[index]].peak_bytes  # no allocator (CPU): live peak
                slot[1] = UNSET
            if peak > step_bytes:
                step_bytes, step_phase = peak, index
            if peak > phase_best[index] or (peak == phase_best[index] and phase_credited[index] and not credited):
                phase_best[index] = peak
                phase_credited[index] = credited
                phase = PHASES[index]
                self._phase_peaks[phase] = self._record(step, index, slot, counted.get(phase), place)
            if peak > interval_phase_best[index]:
                interval_phase_best[index] = peak
        if step_bytes == UNSET:
            return
        if not credited:  # the last step read phase by phase, and the phase a step read once is credited to
            self._current, self._last = self._last, current
            self._last_step_index = step
            self._last_counted = counted
            self._peak_phase = step_phase
        self._recent.append((step, step_bytes))
        slot = current[step_phase]
        run_best = self._peak_bytes
        if step_bytes > run_best or (step_bytes == run_best and self._peak_credited and not credited):
            self._peak_bytes = step_bytes
            self._peak_credited = credited
            self._peak = self._record(step, step_phase, slot, counted.get(PHASES[step_phase]), place)
        best = self._interval_best
        if best is None or step_bytes > best[2]:
            reserved = None if slot[1] == UNSET else slot[1]
            self._interval_best = (step, step_phase, step_bytes, reserved, counted.get(PHASES[step_phase]))

    @staticmethod
    def _peak_record(
        step: int,
        phase_index: int,
        peak_bytes: int,
        reserved: int | None,
        counted: Breakdown | None,
        micro_batch: int | None = None,
    ) -> PhasePeak:
        """A phase peak with ``other`` set where an allocator measured it (``reserved`` known).

        ``micro_batch``: the step's place in its accumulation window, where the step was sampled.
        """
        breakdown = counted
        if counted is not None and reserved is not None:
            breakdown = counted.with_measured_peak(peak_bytes)
        return PhasePeak(step, PHASES[phase_index], peak_bytes, reserved, breakdown, micro_batch)

    def _record(
        self, step: int, phase_index: int, slot: list[int], counted: Breakdown | None, micro_batch: int | None = None
    ) -> PhasePeak:
        reserved = None if slot[1] == UNSET else slot[1]
        return self._peak_record(step, phase_index, slot[0], reserved, counted, micro_batch)

    def _remember(self, attribution: Attribution) -> None:
        first = self.latest_attribution is None
        self.latest_attribution = attribution
        largest = self.largest_activation_attribution
        if largest is None or _activation_bytes(attribution) > _activation_bytes(largest):
            self.largest_activation_attribution = attribution
        if first:
            # Steps measured before the first sample get its counts: model state is the same size after warm-up.
            self._peak = self._with_counts(self._peak, attribution)
            self._phase_peaks = {
                phase: attributed
                for phase, peak in self._phase_peaks.items()
                if (attributed := self._with_counts(peak, attribution)) is not None
            }

    def _with_counts(self, peak: PhasePeak | None, attribution: Attribution) -> PhasePeak | None:
        if peak is None or peak.breakdown is not None:
            return peak
        counted = attribution.phases.get(peak.phase)
        return self._peak_record(peak.step, PHASES.index(peak.phase), peak.peak_bytes, peak.reserved_bytes, counted)

    @property
    def peak(self) -> PhasePeak | None:
        """The highest phase peak of the run."""
        return self._peak

    @property
    def phase_peaks(self) -> dict[Phase, PhasePeak]:
        """The highest peak of each phase."""
        return dict(self._phase_peaks)

    @property
    def recent(self) -> tuple[StepPoint, ...]:
        """The last steps' peaks, oldest first."""
        return tuple(StepPoint(step, peak_bytes) for step, peak_bytes in self._recent)

    @property
    def last_step(self) -> tuple[PhasePeak, ...]:
        """The phases of the last step measured phase by phase."""
        return tuple(
            self._record(self._last_step_index, index, slot, self._last_counted.get(PHASES[index]))
            for index, slot in enumerate(self._last)
            if slot[0] != UNSET
        )

    def start_evaluation_batch(self, reading: AllocatorReading | None) -> None:
        """An evaluation batch starts; ``reading`` is the allocator now."""
        self._evaluation_start = reading

    def end_evaluation_batch(self, stage: str, reading: AllocatorReading | None) -> None:
        """The evaluation batch of ``stage`` (validation, test, predict) ends; each stage keeps its highest peak."""
        start = self._evaluation_start
        if reading is None or start is None:
            return
        peak_bytes = phase_peak_bytes(start, reading, self._reset)
        known = self.evaluation.get(stage)
        if known is None or peak_bytes > known.peak_bytes:
            self.evaluation[stage] = EvaluationPeak(stage, peak_bytes, reading.reserved_bytes, self.steps)

    def take_interval(self) -> IntervalMemory:
        """Memory since the last call, then start a new interval."""
        best = self._interval_best
        interval = IntervalMemory(
            allocated_bytes=self._interval_allocated,
            reserved_bytes=self._interval_reserved,
            peak=None if best is None else self._peak_record(*best),
            phase_peak_bytes={
                phase: peak for phase, peak in zip(PHASES, self._interval_phase_best, strict=True) if peak != UNSET
            },
        )
        self._interval_best = None
        self._interval_phase_best = [UNSET] * len(PHASES)
        return interval

    def state_dict(self) -> dict[str, Any]:
        """The run aggregates as plain data (the current interval and the OOM counter's baseline are not kept)."""
        return {
            "steps": self.steps,
            "optimizer_steps": self.optimizer_steps,
            "peak": phase_peak_to_dict(self._peak),
            "phase_peaks": [phase_peak_to_dict(peak) for peak in self._phase_peaks.values()],
            "recent": [[step, peak_bytes] for step, peak_bytes in self._recent],
            "latest_attribution": attribution_to_dict(self.latest_attribution),
            "largest_activation_attribution": attribution_to_dict(self.largest_activation_attribution),
            "alloc_retries": self.alloc_retries,
            "last_step": [phase_peak_to_dict(peak) for peak in self.last_step],
            "recovered_ooms": self.recovered_ooms,
            "evaluation": evaluation_to_dict(tuple(self.evaluation.values())),
        }

    def load_state_dict(self, state: Any) -> None:
        """Continue the run that :meth:`state_dict` saved.

        Raises:
            FormatError: ``state`` is not what :meth:`state_dict` wrote; nothing is changed then.
        """
        fields = Reader(state, "tracker")
        steps = fields.integer("steps")
        optimizer_steps = fields.added("optimizer_steps", Reader.optional_integer, None)
        peak = optional_phase_peak_from_dict(fields.raw("peak"), "tracker.peak")
        phase_peaks = fields.each("phase_peaks", phase_peak_from_dict)
        recent = fields.each("recent", step_pair_from_list)
        latest = attribution_from_dict(fields.raw("latest_attribution"), "tracker.latest_attribution")
        largest = attribution_from_dict(
            fields.raw("largest_activation_attribution"), "tracker.largest_activation_attribution"
        )
        alloc_retries = fields.optional_integer("alloc_retries")
        last_step = fields.each("last_step", phase_peak_from_dict)
        recovered_ooms = fields.optional_integer("recovered_ooms")
        evaluation = evaluation_from_dict(fields, "evaluation")
        self.steps = steps
        self.optimizer_steps = optimizer_steps
        self._peak = peak
        self._peak_bytes = peak.peak_bytes if peak is not None else UNSET
        self._phase_peaks = {item.phase: item for item in phase_peaks}
        self._phase_best = [
            self._phase_peaks[phase].peak_bytes if phase in self._phase_peaks else UNSET for phase in PHASES
        ]
        self._peak_credited = False
        self._phase_credited = [False] * len(PHASES)
        self._peak_phase = SLOT[peak.phase] if peak is not None else 0
        self._recent.clear()
        self._recent.extend(recent)
        self.latest_attribution = latest
        self.largest_activation_attribution = largest
        self.alloc_retries = alloc_retries
        self._last = [[UNSET, 0] for _ in PHASES]
        for item in last_step:
            self._last[PHASES.index(item.phase)] = [
                item.peak_bytes,
                UNSET if item.reserved_bytes is None else item.reserved_bytes,
            ]
            self._last_step_index = item.step
        self._last_counted = latest.phases if latest is not None else {}
        self.recovered_ooms = recovered_ooms
        self.evaluation = {item.stage: item for item in evaluation}


def _activation_bytes(attribution: Attribution) -> int:
    forward = attribution.phases.get(Phase.FORWARD)
    return forward.activations if forward is not None else 0
