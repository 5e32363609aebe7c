"""Step time and data wait, measured on the host with ``time.perf_counter`` (no device synchronisation).

The clock is the timer's argument, so that tests script the times instead of measuring them.

Data wait is the time between one training batch's end and the next one's start: the DataLoader's
fetch and the transfer to the device (and other callbacks' batch-end work). It is not measured across
epoch boundaries or validation runs.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lightning_vram.records import IntervalTiming
from lightning_vram.records.json_reader import FormatError, Reader

Clock = Callable[[], float]
"""A monotonic host clock, in seconds (``time.perf_counter``)."""
SPREAD_MIN_STEPS = 4
"""The fewest timed steps whose spread is given: their quartiles need four."""


class StepTimer:
    """Accumulates busy and waiting time per interval and over the run; keeps a fixed window of step times.

    Args:
        window: how many recent steps' times are kept.
        clock: read at each batch's start and end, in seconds.
    """

    def __init__(self, window: int, clock: Clock = time.perf_counter) -> None:
        self._clock = clock
        self._window: deque[tuple[float, float]] = deque(maxlen=window)  # (wait, step) seconds
        self._started_at: float | None = None
        self._ended_at: float | None = None
        self._wait_seconds: float | None = None
        self._interval_wait = 0.0
        self._interval_total = 0.0
        self._interval_steps = 0
        self._run_wait = 0.0
        self._run_total = 0.0
        self.timed_steps = 0
        """Steps timed over the run (those that directly followed another batch)."""

    def batch_started(self) -> None:
        """A training batch starts now.

        Raises:
            TypeError: the clock's first reading of a stretch of batches is not a number of seconds (the guard turns
                timing off with a warning that says so).
        """
        now = self._clock()
        if self._ended_at is None and not isinstance(now, (int, float)):  # once a stretch: the hot path stays cheap
            raise TypeError(f"clock must return seconds as a number, got {now!r} ({type(now).__name__})")
        self._wait_seconds = now - self._ended_at if self._ended_at is not None else None
        self._started_at = now

    def batch_ended(self) -> None:
        """The batch that started last ends now.

        Only a batch that followed another one directly counts: its step is the wait plus the work.
        """
        now = self._clock()
        started_at, wait_seconds = self._started_at, self._wait_seconds
        self._started_at = None
        self._ended_at = now
        if started_at is None or wait_seconds is None:
            return
        step_seconds = wait_seconds + (now - started_at)
        self._window.append((wait_seconds, step_seconds))
        self._interval_wait += wait_seconds
        self._interval_total += step_seconds
        self._interval_steps += 1
        self._run_wait += wait_seconds
        self._run_total += step_seconds
        self.timed_steps += 1

    def restart_wait(self) -> None:
        """The time since the last batch ended was the monitor's own (a replay): the next wait starts now."""
        if self._ended_at is not None:
            self._ended_at = self._clock()

    def break_continuity(self) -> None:
        """Time until the next batch is not data wait (an epoch boundary, a validation run)."""
        self._ended_at = None

    def state_dict(self) -> dict[str, Any]:
        """The run's timing as plain data (the interval in progress is not kept)."""
        return {
            "window": [list(pair) for pair in self._window],
            "run_wait": self._run_wait,
            "run_total": self._run_total,
            "timed_steps": self.timed_steps,
        }

    def load_state_dict(self, state: Any) -> None:
        """Continue the run that :meth:`state_dict` saved.

        Raises:
            FormatError: ``state`` is not what :meth:`state_dict` wrote; nothing is changed then.
        """
        fields = Reader(state, "timer")
        window = fields.each("window", _wait_and_step)
        run_wait, run_total = fields.number("run_wait"), fields.number("run_total")
        timed_steps = fields.integer("timed_steps")
        self._window.clear()
        self._window.extend(window)
        self._run_wait, self._run_total, self.timed_steps = run_wait, run_total, timed_steps

    def take_interval(self) -> IntervalTiming:
        """Timing since the last call, then start a new interval."""
        timing = IntervalTiming(
            step_seconds=self._interval_total / self._interval_steps if self._interval_steps else None,
            data_wait_fraction=self._interval_wait / self._interval_total if self._interval_total > 0 else None,
        )
        self._interval_wait = self._interval_total = 0.0
        self._interval_steps = 0
        return timing

    def median_step_seconds(self) -> float | None:
        """Median step time over the recent window, in seconds."""
        return statistics.median(step for _, step in self._window) if self._window else None

    def step_time_iqr_fraction(self) -> float | None:
        """How much the recent window's step times vary: their interquartile range over their median (a fraction).

        ``None`` with fewer than :data:`SPREAD_MIN_STEPS` steps timed in the window, or a median of zero.
        """
        steps = [step for _, step in self._window]
        median = statistics.median(steps) if len(steps) >= SPREAD_MIN_STEPS else 0.0
        if median <= 0:
            return None
        first, _, third = statistics.quantiles(steps, n=4, method="inclusive")
        return (third - first) / median

    def recent_data_wait_fraction(self) -> float | None:
        """Share of step time spent waiting for data over the recent window."""
        total = sum(step for _, step in self._window)
        return sum(wait for wait, _ in self._window) / total if total > 0 else None

    def data_wait_fraction(self) -> float | None:
        """Share of the run's step time spent waiting for data."""
        return self._run_wait / self._run_total if self._run_total > 0 else None


def _wait_and_step(data: Any, where: str) -> tuple[float, float]:
    if (
        not isinstance(data, list)
        or len(data) != 2
        or not all(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 for value in data)
    ):
        raise FormatError(f"{where} must be [wait_seconds, step_seconds], two numbers >= 0, got {data!r}")
    return float(data[0]), float(data[1])
