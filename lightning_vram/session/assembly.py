"""Putting a run's measurements together: its summary, what was not measured, the ranks' headlines, the scalars.

The only part that talks to the other ranks (:class:`Ranks`): one gather before step 0 (preflight's verdicts), one
per log interval and one at the end, and a barrier while rank zero writes the files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

from lightning_vram._guard import Guard, Part
from lightning_vram.advice.report import build_report
from lightning_vram.config import MonitorConfig
from lightning_vram.records import (
    IntervalMemory,
    NotMeasured,
    RankPreflight,
    RankSummary,
    Report,
    RunSummary,
    Simulation,
    TrainingSetup,
    UtilizationReading,
)
from lightning_vram.render.scalars import interval_scalars, reduce_over_ranks, scalar_vector
from lightning_vram.session.recorder import Interval, StepRecorder

Gather = Callable[[list[float]], list[list[float]]]
"""Every rank's list of numbers (the same length on each), rank by rank: one collective."""

NO_SCALARS: Mapping[str, float] = MappingProxyType({})
"""What :meth:`~lightning_vram.VramSession.batch_end` returns between log intervals."""
NO_STEP = NotMeasured(
    "training steps", "no training step ran (max_steps=0, max_epochs=0, limit_train_batches=0 or an empty loader)"
)


def cuda_context_bytes(utilization: UtilizationReading | None, memory: IntervalMemory) -> int | None:
    """What NVML sees of the process beyond the allocator's reserve (the CUDA context and library workspaces), bytes.

    ``None`` where either side was not measured.
    """
    if utilization is None or utilization.process_memory_bytes is None or not memory.reserved_bytes:
        return None
    return max(utilization.process_memory_bytes - memory.reserved_bytes, 0)


class Assembly:
    """Puts one run's measurements together: its summary, scalars, ``not_measured`` and report.

    Args:
        config: the monitor's settings (``top_modules``, ``attribution_start_step``).
        guard: the run's guard (scalars, the report).
        recorder: the run's readings, peaks and times.
        ranks: this rank among the others.
        notes: what the other parts could not measure, read when the report is built.
    """

    def __init__(
        self,
        config: MonitorConfig,
        guard: Guard,
        recorder: StepRecorder,
        ranks: Ranks,
        notes: Callable[[], list[NotMeasured]],
        length_peaks: Callable[[], tuple[tuple[int, int], ...]],
    ) -> None:
        self._config, self._guard, self._recorder, self._ranks, self._notes = config, guard, recorder, ranks, notes
        self._length_peaks = length_peaks
        self.cuda_context_bytes: int | None = None
        """The CUDA context's estimate from the last log interval that measured it, bytes (``None`` before)."""

    def interval_scalars(self) -> Mapping[str, float]:
        """The ``vram/...`` scalars of the log interval that ends now (over every rank: one gather).

        The interval's readings also update :attr:`cuda_context_bytes`.
        """
        guard = self._guard
        interval = guard.call(Part.SCALARS, self._recorder.take_interval)
        scalars: dict[str, float] = {}
        if interval is not None:
            estimate = cuda_context_bytes(interval.utilization, interval.memory)
            if estimate is not None:
                self.cuda_context_bytes = estimate
            scalars = guard.call(Part.SCALARS, local_scalars, interval) or {}
        return self._ranks.reduce_scalars(scalars)

    def summary(self) -> RunSummary:
        """What the run measured so far.

        Raises:
            RuntimeError: the recorder never opened a probe (``VramSession.start`` was not called).
        """
        recorder = self._recorder
        tracker, timer, device = recorder.tracker, recorder.timer, recorder.device
        if device is None:
            raise RuntimeError("VramSession.summary() needs start() first")
        largest = tracker.largest_activation_attribution
        return RunSummary(
            device=device,
            peak=tracker.peak,
            phases=tracker.phase_peaks,
            modules=largest.modules if largest is not None else (),
            batch_size=largest.batch_size if largest is not None else None,
            step_seconds_median=timer.median_step_seconds(),
            step_time_iqr_fraction=timer.step_time_iqr_fraction(),
            data_wait_fraction=timer.data_wait_fraction(),
            recent_data_wait_fraction=timer.recent_data_wait_fraction(),
            timed_steps=timer.timed_steps,
            gpu_utilization_mean=recorder.mean_utilization_percent(),
            alloc_retries=tracker.alloc_retries,
            cuda_context_bytes=self.cuda_context_bytes,
            recovered_ooms=tracker.recovered_ooms,
            last_step=tracker.last_step,
            steps=tracker.steps,
            optimizer_steps=tracker.optimizer_steps,
            recent_peaks=tracker.recent,
            evaluation=tuple(tracker.evaluation.values()),
            length_counts=tuple(sorted(recorder.shapes.length_counts.items())),
            length_peaks=self._length_peaks(),
            recomputed_units=largest.recomputed_units if largest is not None else None,
            selective_units=largest.selective_units if largest is not None else None,
        )

    def not_measured(self) -> tuple[NotMeasured, ...]:
        """The report's ``not_measured``: the probe's gaps, the parts' notes and every part that failed."""
        recorder, guard = self._recorder, self._guard
        tracker = recorder.tracker
        found = recorder.unavailable()
        if tracker.steps == 0:
            found.append(NO_STEP)
        found += self._notes()
        start = self._config.attribution_start_step
        if tracker.latest_attribution is None and 0 < tracker.steps <= start and guard.enabled(Part.ATTRIBUTION):
            found.append(
                NotMeasured("tensor-by-tensor attribution", f"no training batch reached attribution_start_step={start}")
            )
        return (*found, *guard.not_measured)

    def report(
        self, setup: Callable[[], TrainingSetup | None], simulation: Simulation | None, gather_ranks: bool
    ) -> Report | None:
        """The run's report; ``None`` where it could not be built.

        With ``gather_ranks``, it carries every rank's headline (one gather every rank joins).
        """
        recorder = self._recorder
        peak, device = recorder.tracker.peak, recorder.device
        own = RankSummary(
            rank=self._ranks.rank,
            device_index=device.index if device is not None else None,
            peak_bytes=peak.peak_bytes if peak is not None else None,
            steps=recorder.tracker.steps,
        )
        ranks = self._ranks.summaries(own, gather_ranks)

        def build() -> Report:
            return build_report(
                self.summary(),
                setup(),
                top_modules=self._config.top_modules,
                ranks=ranks,
                not_measured=self.not_measured(),
                simulation=simulation,
            )

        return self._guard.call(Part.REPORT, build)


def local_scalars(interval: Interval) -> dict[str, float]:
    """The rank's own ``vram/...`` scalars of a log interval."""
    return interval_scalars(interval.memory, interval.timing, interval.utilization, interval.host_rss_bytes)


class Ranks:
    """The rank among the processes training together, and the monitor's collectives with the others.

    A collective that fails (a rank gone) warns once and ends the monitor's collectives for the run: its report
    covers this rank.

    Args:
        guard: the run's guard (:attr:`~lightning_vram._guard.Part.RANKS`).
        rank: this process's global rank.
        world_size: the number of processes training together.
        gather: every rank's numbers (one collective); ``None`` gathers nothing.
        barrier: waits until every rank calls it (one collective); ``None`` waits for none.
    """

    def __init__(
        self,
        guard: Guard,
        rank: int = 0,
        world_size: int = 1,
        gather: Gather | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        self.guard = guard
        """The run's guard: the parts of a run share it."""
        self.rank, self.world_size = rank, world_size
        self._gather, self._barrier = gather, barrier

    def reduce_scalars(self, scalars: dict[str, float]) -> dict[str, float]:
        """The scalars rank zero logs: with several ranks, each one's maximum over the ranks (one gather)."""
        gather = self._gather
        if self.world_size <= 1 or gather is None:
            return scalars
        # Every rank reaches this at the same step and joins the gather, whatever failed on it: one collective.
        vector = scalar_vector(scalars)
        rows = self.guard.call(Part.RANKS, gather, vector)
        return scalars if rows is None else reduce_over_ranks(rows)

    def summaries(self, own: RankSummary, gather_ranks: bool) -> tuple[RankSummary, ...]:
        """Every rank's headline (one gather when ``gather_ranks`` and there are several); else this rank's."""
        gather = self._gather
        if not gather_ranks or self.world_size <= 1 or gather is None:
            return (own,)
        rows = self.guard.call(Part.RANKS, gather, _rank_row(own))
        return (own,) if rows is None else tuple(map(_rank_from_row, enumerate(rows)))

    def agree_preflight(self, own: RankPreflight) -> tuple[RankPreflight, ...]:
        """Every rank's preflight verdict, rank by rank (one gather every rank joins, before step 0); else ``own``.

        Each rank joins exactly once whatever its own preflight did (a skipped one carries ``fits=None``), so no rank
        waits for one that has nothing to say. A gather that fails warns once (the guard): this rank's row alone.
        """
        gather = self._gather
        if self.world_size <= 1 or gather is None:
            return (own,)
        rows = self.guard.call(Part.RANKS, gather, _preflight_row(own))
        if rows is None or len(rows) != self.world_size:
            return (own,)
        return tuple(own if rank == self.rank else _preflight_from_row(rank, row) for rank, row in enumerate(rows))

    def meet(self, gather_ranks: bool) -> None:
        """With several ranks and ``gather_ranks``, wait at the barrier until every rank is there."""
        barrier = self._barrier
        if gather_ranks and self.world_size > 1 and barrier is not None:
            self.guard.call(Part.RANKS, barrier)

    def release(self) -> None:
        """Let go of the collectives (they hold the Trainer, and through it the process group)."""
        self._gather = self._barrier = None


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


def _preflight_row(own: RankPreflight) -> list[float]:
    """A rank's preflight verdict as numbers for a gather: fits (1, 0, NaN: skipped), needed, available, peak bytes."""
    values = (None if own.fits is None else int(own.fits), own.needed_bytes, own.available_bytes, own.peak_bytes)
    return [math.nan if value is None else float(value) for value in values]


def _preflight_from_row(rank: int, row: list[float]) -> RankPreflight:
    fits, needed, available, peak = (None if math.isnan(value) else int(value) for value in row)
    return RankPreflight(rank, None if fits is None else bool(fits), needed, available, peak)
