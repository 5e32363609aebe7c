"""Memory during one replayed step, sampled after every op: live bytes by part, at most :data:`MAX_POINTS` points.

The live total is the replay's :class:`~lightning_vram.prediction.replay.live.LiveMemory` (every live tensor, the
allocator's blocks on CUDA); the counted parts are what the replay's counter holds at that moment
(:meth:`~lightning_vram.measure.accounting.StepAttributor.live_parts`), and ``other`` is the total beyond them
(temporaries, and on CUDA the blocks' rounding; never below zero). The live total rises only when an op's outputs
are tracked, so a sample after every op and at every phase's start sees the replay's peak exactly. A long step
keeps, for each window of consecutive samples, the highest one; when the points fill up, neighbours merge in pairs
and windows double.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_vram.records import Phase, StepTimeline, TimelinePoint

MAX_POINTS = 1000
"""The most points a timeline keeps (each the highest of its window of ops)."""

Parts = Callable[[], tuple[int, int, int, int]]
"""() -> (parameters, gradients, optimizer state, activations) alive now, in bytes."""


Sample = tuple[int, int, Phase, int, int, int, int, int]
"""(total, op, phase, parameters, gradients, optimizer state, activations, other): a point before it is kept, as a
plain tuple (cheaper per op than a frozen record)."""


def _higher(first: Sample, second: Sample) -> Sample:
    """The higher of two samples; the first on a tie."""
    return second if second[0] > first[0] else first


class TimelineRecorder:
    """Samples a replayed step: :meth:`start_phase`, :meth:`sample` after every op, then :meth:`finish`.

    ``live_bytes`` reads the live total (bytes), ``parts`` the counted parts, ``module`` the module running now.
    """

    def __init__(
        self,
        live_bytes: Callable[[], int],
        parts: Parts,
        module: Callable[[], str | None],
        max_points: int = MAX_POINTS,
    ) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be at least 2, got {max_points}")
        self._live_bytes = live_bytes
        self._parts = parts
        self._module = module
        self._max_points = max_points
        self._points: list[Sample] = []
        self._window = 1
        self._in_window = 0
        self._pending: Sample | None = None
        self._ops = 0
        self._phase = Phase.FORWARD
        self._phase_starts: list[tuple[Phase, int]] = []
        self._peak_total = -1
        self._peak_module: str | None = None
        self._peak_op: str | None = None
        self._entries: dict[str, int] = {}
        self._last_module: str | None = None

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts now (after ``ops`` ops): sample what is alive as it starts."""
        self._phase = phase
        self._phase_starts.append((phase, self._ops))
        self._record(None)

    def sample(self, op: str) -> None:
        """Op ``op`` ran (its outputs are counted): sample what is alive now."""
        self._ops += 1
        self._record(op)

    def _record(self, op: str | None) -> None:
        if self._phase is Phase.FORWARD:
            self._enter(self._module())
        total = self._live_bytes()
        parameters, gradients, state, activations = self._parts()
        other = max(total - parameters - gradients - state - activations, 0)
        total = parameters + gradients + state + activations + other
        sample = (total, self._ops, self._phase, parameters, gradients, state, activations, other)
        if total > self._peak_total:
            self._peak_total, self._peak_module, self._peak_op = total, self._module(), op
        pending = self._pending
        self._pending = sample if pending is None else _higher(pending, sample)
        self._in_window += 1
        if self._in_window == self._window:
            self._close_window()

    def _enter(self, module: str | None) -> None:
        """``module`` runs now in forward: it and each module holding it entered by this op, if not before."""
        if module is None or module == self._last_module:
            return
        self._last_module = module
        parts = module.split(".")
        for length in range(1, len(parts) + 1):
            self._entries.setdefault(".".join(parts[:length]), self._ops)

    def _close_window(self) -> None:
        if self._pending is not None:
            self._points.append(self._pending)
        self._pending, self._in_window = None, 0
        if len(self._points) >= self._max_points:
            points = self._points
            self._points = [_higher(points[index], points[index + 1]) for index in range(0, len(points) - 1, 2)]
            if len(points) % 2:
                self._points.append(points[-1])
            self._window *= 2

    def finish(self) -> StepTimeline | None:
        """The timeline sampled (``None`` when nothing was)."""
        self._close_window()
        if not self._points:
            return None
        points = tuple(TimelinePoint(*sample[1:]) for sample in self._points)
        peak_index = next(index for index, point in enumerate(points) if point.total == self._peak_total)
        entries = tuple(sorted(self._entries.items(), key=lambda entry: entry[1]))
        return StepTimeline(
            points, self._ops, tuple(self._phase_starts), peak_index, self._peak_module, self._peak_op, entries
        )
