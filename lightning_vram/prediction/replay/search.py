"""The largest batch whose replayed peak fits each of several memory budgets: solved on checked lines, not bisected.

A phase's peak (forward, backward, optimizer step) is affine in the batch size wherever nothing changes kernel with
it (every tensor alive at the phase's peak holds a fixed number of bytes per sample), and convex in any case (the
highest of affine live counts over the phase's moments). The step's peak is the highest phase's: convex too, but
with a kink where one phase overtakes another. So the search keeps one line per phase: two replays give every
phase's line, the lines give every budget's batch at once (the largest batch no phase's line puts over it), and a
replay where the lines are least sure (the solution farthest from every batch replayed) checks them. Where a check
agrees with a phase's line through its two neighbours, that phase is affine over their span (a convex function that
meets a chord inside it is that chord), and each budget whose answer falls where every phase is so is read off the
lines, unless its boundary is too close to call within the lines' error. Where a check disagrees it becomes a point
of that phase's line (a polyline, then), and the next check goes where the lines are least sure. A budget the
checks leave unsettled is searched by replaying around the lines' answer (strides, then bisection: a handful of
replays when the answer is close). Each batch size is replayed at most once, for all budgets together.

A caller that only has the step's peak gives it as one phase: the same search on one line, which a kink bends.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MAX_BATCH_SIZE = 1 << 16
"""The largest batch size searched (65,536): a bound for models whose peak hardly grows with the batch, and for
steps whose replay time grows with it (a loop over the samples). A search that ends there reports "at least"."""

LINE_CHECKS = 4
"""Most replays spent checking the line before each budget still unsettled is searched on its own."""

MIN_LINE_ERROR_BYTES = 4 * 1024
"""The least error, in bytes, a checked line is given: eight 512-byte allocator blocks, for the rounding of
tensors whose size the checks did not catch at a block boundary."""

SECANT_STEPS = 4
"""Most answers an unsettled budget tries on the line, bent by each replay, before it is searched for by strides."""

AGREEMENT_SAMPLES = 0.25
"""Three replays agree on a line when the most the peak can leave it between them is at most this many samples'
bytes (or twice the least error)."""


PhasePeaks = tuple[int, ...]
"""A replayed step's peak per phase, bytes, each phase at the same place in every replay (the step's peak is the
highest)."""

Replayed = int | PhasePeaks | None
"""What a replay of one batch size gives the search: the step's peak, its peak per phase, or ``None`` where the
replay failed (or was not run)."""


def _as_phases(replayed: Replayed) -> PhasePeaks | None:
    """A replay's result as phase peaks: a lone peak is one phase."""
    return (replayed,) if isinstance(replayed, int) else replayed


class _Peaks:
    """Replayed peaks by batch size, each replayed once; ``None`` for a replay that failed (or was not run)."""

    def __init__(
        self, peak_bytes: Callable[[int], Replayed], known: Mapping[int, int | PhasePeaks] | None = None
    ) -> None:
        self._peak_bytes = peak_bytes
        self._known: dict[int, PhasePeaks | None] = {size: _as_phases(peaks) for size, peaks in (known or {}).items()}
        self.replays = 0
        """How many replays this search ran (known peaks not counted)."""

    def phases(self, batch_size: int) -> PhasePeaks | None:
        """The batch's peak per phase (replayed now if it was not yet), ``None`` when its replay failed."""
        if batch_size not in self._known:
            self.replays += 1
            self._known[batch_size] = _as_phases(self._peak_bytes(batch_size))
        return self._known[batch_size]

    def __call__(self, batch_size: int) -> int | None:
        """The batch's step peak (its highest phase's), bytes; ``None`` when its replay failed."""
        phases = self.phases(batch_size)
        return None if phases is None else max(phases)

    def replayed_sizes(self) -> list[int]:
        """The batch sizes whose peaks are known."""
        return [size for size, peaks in self._known.items() if peaks is not None]

    def fits(self, batch_size: int, budget_bytes: int) -> bool | None:
        """Whether the batch's peak is within ``budget_bytes``; ``None`` when its replay failed."""
        peak = self(batch_size)
        return None if peak is None else peak <= budget_bytes


@dataclass(frozen=True)
class _Span:
    """Batch sizes from ``low`` to ``high`` over which three replays agree on ``peak = intercept + slope * batch``.

    Inside, the peak is on the line to within ``error_bytes``: a convex peak that meets a chord inside its ends is
    that chord between them.
    """

    low: int
    high: int
    intercept: float
    slope: float
    error_bytes: float

    def __call__(self, batch_size: int) -> float:
        """The span's line at ``batch_size``, in bytes."""
        return self.intercept + self.slope * batch_size


class Polyline:
    """The peak between replayed batch sizes, linear between neighbours and extended by the end segments.

    >>> line = Polyline([(8, 1000), (16, 1800)])
    >>> line.solve(2000, limit=100), line.solve(500, limit=100)
    (18, 3)
    """

    def __init__(self, points: Sequence[tuple[int, int]]) -> None:
        self.points = sorted(points)
        self.spans: list[_Span] = []
        for index in range(1, len(self.points) - 1):
            self._check(index)

    def add(self, batch_size: int, peak_bytes: int) -> None:
        """A replayed point becomes part of the line (once); where it agrees with its neighbours, a span."""
        if self.has(batch_size):
            return
        bisect.insort(self.points, (batch_size, peak_bytes))
        index = self.points.index((batch_size, peak_bytes))
        for middle in (index - 1, index, index + 1):
            if 0 < middle < len(self.points) - 1:
                self._check(middle)

    def _check(self, middle: int) -> None:
        """Add a span where the point at ``middle`` lies on the chord of its neighbours."""
        (x0, y0), (x, y), (x1, y1) = self.points[middle - 1 : middle + 2]
        slope = (y1 - y0) / (x1 - x0)
        residual = abs(y - (y0 + slope * (x - x0)))
        # A convex peak leaves its chord by at most the middle's residual times this (the most at a kink, falling
        # linearly to the ends): a middle close to an end says little.
        error = MIN_LINE_ERROR_BYTES + residual * (x1 - x0) / min(x - x0, x1 - x)
        if error <= max(2 * MIN_LINE_ERROR_BYTES, AGREEMENT_SAMPLES * slope):
            self.spans.append(_Span(x0, x1, y0 - slope * x0, slope, error))

    def has(self, batch_size: int) -> bool:
        """Whether the line passes through a replay of ``batch_size``."""
        return any(x == batch_size for x, _ in self.points)

    def segment(self, batch_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two replayed points around ``batch_size`` (the end pair beyond them)."""
        index = bisect.bisect_left([x for x, _ in self.points], batch_size)
        index = min(max(index, 1), len(self.points) - 1)
        return self.points[index - 1], self.points[index]

    def slope(self, batch_size: int) -> float:
        """Bytes per sample of the segment around ``batch_size``."""
        (x0, y0), (x1, y1) = self.segment(batch_size)
        return (y1 - y0) / (x1 - x0)

    def solve(self, budget_bytes: int, limit: int) -> int:
        """The largest batch from 0 to ``limit`` the line keeps within ``budget_bytes``.

        ``limit`` when the line never leaves the budget.
        """
        over = next((x for x, y in self.points if y > budget_bytes), None)
        anchor = over if over is not None else self.points[-1][0]
        (x0, y0), _ = self.segment(anchor)
        slope = self.slope(anchor)
        if slope <= 0:
            return limit if over is None else 0
        return min(max(x0 + int((budget_bytes - y0) // slope), 0), limit)

    def covered(self, batch_size: int) -> bool:
        """Whether a span holds ``batch_size``: the line needs no replay there."""
        return any(span.low <= batch_size <= span.high for span in self.spans)

    def surely_fits(self, batch_size: int, budget_bytes: int) -> bool:
        """Whether a span holds ``batch_size`` with its peak at least the span's error under the budget."""
        return any(
            span.low <= batch_size <= span.high and span(batch_size) + span.error_bytes <= budget_bytes
            for span in self.spans
        )

    def surely_over(self, batch_size: int, budget_bytes: int) -> bool:
        """Whether the peak at ``batch_size`` is over the budget.

        It is where it was replayed so, or where a span holds it with its line over by more than the span's error.
        (Past a span its line is a floor only for a peak that is convex to the byte: allocator rounding is not.)
        """
        known = next((y for x, y in self.points if x == batch_size), None)
        if known is not None:
            return known > budget_bytes
        return any(
            span.low <= batch_size <= span.high and span(batch_size) - span.error_bytes > budget_bytes
            for span in self.spans
        )


class PhaseLines:
    """One :class:`Polyline` per phase through the same replays; the step's peak is the highest phase's.

    A batch is settled where every phase's line is (a checked span holds it), and fits where every phase does.

    >>> lines = PhaseLines([(8, (1000, 900)), (16, (1800, 1500))])
    >>> lines.solve(2000, limit=100), lines.solve(1200, limit=100)
    (18, 10)
    """

    def __init__(self, points: Sequence[tuple[int, PhasePeaks]]) -> None:
        phases = {len(peaks) for _, peaks in points}
        if len(phases) != 1:
            raise ValueError(f"every replay must give the same number of phases, got {sorted(phases)}")
        self.lines = tuple(Polyline([(size, peaks[phase]) for size, peaks in points]) for phase in range(phases.pop()))

    @property
    def sizes(self) -> list[int]:
        """The batch sizes replayed, smallest first."""
        return [x for x, _ in self.lines[0].points]

    def add(self, batch_size: int, peaks: PhasePeaks) -> None:
        """A replay's phase peaks join each phase's line (once)."""
        for line, peak in zip(self.lines, peaks, strict=True):
            line.add(batch_size, peak)

    def has(self, batch_size: int) -> bool:
        """Whether the lines pass through a replay of ``batch_size``."""
        return self.lines[0].has(batch_size)

    def solve(self, budget_bytes: int, limit: int) -> int:
        """The largest batch from 0 to ``limit`` that no phase's line puts over ``budget_bytes``."""
        return min(line.solve(budget_bytes, limit) for line in self.lines)

    def covered(self, batch_size: int) -> bool:
        """Whether every phase's line holds ``batch_size`` in a checked span."""
        return all(line.covered(batch_size) for line in self.lines)

    def surely_fits(self, batch_size: int, budget_bytes: int) -> bool:
        """Whether every phase surely fits the budget at ``batch_size`` (in a span, clear of its error)."""
        return all(line.surely_fits(batch_size, budget_bytes) for line in self.lines)

    def surely_over(self, batch_size: int, budget_bytes: int) -> bool:
        """Whether some phase is surely over the budget at ``batch_size`` (replayed so, or clear of a span's error)."""
        return any(line.surely_over(batch_size, budget_bytes) for line in self.lines)


def largest_batches_that_fit(
    peak_bytes: Callable[[int], Replayed],
    budgets_bytes: Sequence[int],
    start: int,
    limit: int = MAX_BATCH_SIZE,
    known: Mapping[int, int | PhasePeaks] | None = None,
) -> tuple[tuple[int | None, ...], int]:
    """For each budget, the largest batch size from 1 to ``limit`` whose peak is at most it, and the replays run.

    Args:
        peak_bytes: the replayed peak of a batch size, or its peak per phase (a line each: a kink where one phase
            overtakes another costs no replays), ``None`` where the replay failed (its peak grows with the batch
            size).
        budgets_bytes: the memory the step may take on each device.
        start: a batch size to start from (the run's own).
        limit: the largest batch size considered.
        known: peaks already replayed (as ``peak_bytes`` gives them), by batch size (the baseline's): not replayed
            again.

    Returns:
        Per budget the batch size (0 when a batch of 1 does not fit; ``None`` where a replay it needed failed),
        and how many replays the search ran.

    Two replays (8 and 16) and a check (200) settle every budget inside their span; the check's own answer needs
    the next batch replayed (201), past the span:

    >>> budgets = [20_500_000, 100_500_000, 200_500_000]
    >>> largest_batches_that_fit(lambda batch: 1000 + 1_000_000 * batch, budgets, start=8)
    ((20, 100, 200), 4)

    A step whose backward peak overtakes its forward peak at batch 40 has a kink there; given per phase, each
    phase's line is straight and the budgets are settled in as many replays as on a straight line:

    >>> def phases(batch):
    ...     return (60_000_000 + 500_000 * batch, 20_000_000 + 1_500_000 * batch)
    >>> largest_batches_that_fit(phases, [150_750_000, 300_750_000, 600_750_000], start=8)
    ((87, 187, 387), 4)
    """
    peaks = _Peaks(peak_bytes, known)
    start = min(max(start, 1), limit)
    line = checked_line(peaks, budgets_bytes, start, limit)
    answers = [
        _settle(peaks, line, budget, limit) if line is not None else _search_around(peaks, budget, start, limit)
        for budget in budgets_bytes
    ]
    return tuple(answers), peaks.replays


def checked_line(peaks: _Peaks, budgets_bytes: Sequence[int], start: int, limit: int) -> PhaseLines | None:
    """The phases' lines through the replays, checked (and bent where one disagrees) up to :data:`LINE_CHECKS` times.

    The replays are ``start``'s and those already known, or twice ``start``'s when none is. Each check replays the
    answer farthest from what is known; where it agrees with its neighbours their span is affine. ``None`` when a
    first replay failed or the batch size cannot vary.
    """
    replayed = [size for size in peaks.replayed_sizes() if size != start]
    other = max(replayed) if replayed else min(2 * start, limit) if start < limit else max(start - 1, 1)
    first, second = peaks(start), peaks(other)
    if first is None or second is None or other == start:
        return None
    line = PhaseLines([(size, phases) for size in peaks.replayed_sizes() if (phases := peaks.phases(size)) is not None])
    for _ in range(LINE_CHECKS):
        check = _least_known(line, budgets_bytes, limit)
        if check is None:
            break
        phases = peaks.phases(check)
        if phases is None:
            break
        line.add(check, phases)
    return line


def _least_known(line: PhaseLines, budgets_bytes: Sequence[int], limit: int) -> int | None:
    """The batch to check the lines at, ``None`` when there is none.

    That is the budgets' answer outside every checked span farthest (by ratio) from every batch replayed.
    """
    known = line.sizes
    answers = {min(max(line.solve(budget, limit), 1), limit) for budget in budgets_bytes}
    candidates = [size for size in answers if size not in known and not line.covered(size)]
    if not candidates:
        return None
    return max(candidates, key=lambda size: min(max(size, x) / min(size, x) for x in known))


def _settle(peaks: _Peaks, line: PhaseLines, budget_bytes: int, limit: int) -> int | None:
    """The budget's largest batch: the line's answer, replayed only where the line does not settle it.

    The answer stands when it surely fits (in a span, clear of its error, or replayed within the budget) and the
    next batch is surely over (replayed so, or above a span's line by more than its error). Each replay joins the
    line, which bends to the peak there, for up to :data:`SECANT_STEPS` answers; then the answer is searched for
    around the last one. ``None`` on a failed replay.
    """
    guess = 1
    for _ in range(SECANT_STEPS):
        guess = line.solve(budget_bytes, limit)
        if guess == 0:
            break
        if not line.surely_fits(guess, budget_bytes):
            phases = peaks.phases(guess)
            if phases is None:
                return None
            line.add(guess, phases)
            if max(phases) > budget_bytes:
                continue
        if guess == limit or line.surely_over(guess + 1, budget_bytes):
            return guess
        following = peaks.phases(guess + 1)
        if following is None:
            return None
        line.add(guess + 1, following)
        if max(following) > budget_bytes:
            return guess
    return _search_around(peaks, budget_bytes, max(guess, 1), limit)


def largest_batch_that_fits(
    peak_bytes: Callable[[int], Replayed], budget_bytes: int, start: int, limit: int = MAX_BATCH_SIZE
) -> int | None:
    """The largest batch size from 1 to ``limit`` whose peak is at most ``budget_bytes``.

    One budget of :func:`largest_batches_that_fit`: 0 when a batch of 1 does not fit; ``None`` when a replay
    needed failed.

    >>> largest_batch_that_fits(lambda batch: 1000 + 10 * batch, budget_bytes=2000, start=8)
    100
    """
    (answer,), _ = largest_batches_that_fit(peak_bytes, [budget_bytes], start, limit)
    return answer


def _search_around(peaks: _Peaks, budget_bytes: int, guess: int, limit: int) -> int | None:
    """The budget's largest batch by replays alone; ``None`` on a failed replay.

    Strides away from ``guess`` (doubling) until the answer is bracketed, then bisects: a close guess costs two
    replays, a far one about ``2 * log2(distance)``.
    """
    bracket = _bracket(peaks, budget_bytes, guess, limit)
    if bracket is None:
        return None
    low, high = bracket
    while high - low > 1:
        middle = (low + high) // 2
        fits = peaks.fits(middle, budget_bytes)
        if fits is None:
            return None
        low, high = (middle, high) if fits else (low, middle)
    return low


def _bracket(peaks: _Peaks, budget_bytes: int, guess: int, limit: int) -> tuple[int, int] | None:
    """``(low, high)`` with ``low`` fitting (0 when nothing does) and ``high`` not (``limit + 1`` when all do).

    ``None`` on a failed replay. Steps away from ``guess`` in doubling strides: a close guess costs a replay or two.
    """
    step = 1
    fits = peaks.fits(guess, budget_bytes)
    if fits is None:
        return None
    if fits:
        low = guess
        while low < limit:
            high = min(low + step, limit)
            fits = peaks.fits(high, budget_bytes)
            if fits is None:
                return None
            if not fits:
                return low, high
            low, step = high, step * 2
        return limit, limit + 1
    high = guess
    while high > 1:
        low = max(high - step, 1)
        fits = peaks.fits(low, budget_bytes)
        if fits is None:
            return None
        if fits:
            return low, high
        high, step = low, step * 2
    return 0, 1
