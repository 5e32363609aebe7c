"""The largest batch whose replayed peak fits a memory budget, found by replaying, not by extrapolating.

A step's peak grows with the batch almost linearly, so two replays give a first guess; replays around the guess
then bracket the exact answer and bisection finds it. Each batch size is replayed at most once.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_BATCH_SIZE = 1 << 16
"""The largest batch size searched (65,536): a bound for models whose peak hardly grows with the batch, and for
steps whose replay time grows with it (a loop over the samples). A search that ends there reports "at least"."""


class _Peaks:
    """Replayed peaks by batch size, each replayed once; ``None`` once a replay fails."""

    def __init__(self, peak_bytes: Callable[[int], int | None]) -> None:
        self._peak_bytes = peak_bytes
        self._known: dict[int, int | None] = {}
        self.failed = False

    def __call__(self, batch_size: int) -> int | None:
        if batch_size not in self._known:
            self._known[batch_size] = self._peak_bytes(batch_size)
        peak = self._known[batch_size]
        if peak is None:
            self.failed = True
        return peak


def largest_batch_that_fits(
    peak_bytes: Callable[[int], int | None], budget_bytes: int, start: int, limit: int = MAX_BATCH_SIZE
) -> int | None:
    """The largest batch size from 1 to ``limit`` whose peak is at most ``budget_bytes``.

    Args:
        peak_bytes: the replayed peak of a batch size, ``None`` where the replay failed (its peak grows with the
            batch size).
        budget_bytes: the memory the step may take.
        start: a batch size to start from (the run's own).
        limit: the largest batch size considered.

    Returns:
        The batch size; 0 when a batch of 1 does not fit; ``None`` when a replay needed failed.

    >>> largest_batch_that_fits(lambda batch: 1000 + 10 * batch, budget_bytes=2000, start=8)
    100
    """
    peaks = _Peaks(peak_bytes)
    start = min(max(start, 1), limit)
    guess = _linear_guess(peaks, budget_bytes, start, limit)
    if guess is None:
        return None

    def fits(batch: int) -> bool | None:
        peak = peaks(batch)
        return None if peak is None else peak <= budget_bytes

    low, high = _bracket(fits, guess, limit)
    while not peaks.failed and high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return None if peaks.failed else low


def _linear_guess(peaks: _Peaks, budget_bytes: int, start: int, limit: int) -> int | None:
    """Where the line through the replayed peaks meets the budget: a secant refined twice; ``None`` on failure."""
    first = peaks(start)
    other = min(2 * start, limit) if start < limit else max(start - 1, 1)
    if first is None or other == start:
        return None if first is None else start
    guess = other
    for _ in range(3):
        peak = peaks(guess)
        if peak is None:
            return None
        slope = (peak - first) / (guess - start)
        if slope <= 0:
            return limit
        refined = min(max(int(start + (budget_bytes - first) / slope), 1), limit)
        if refined == guess:
            break
        guess = refined
    return guess


def _bracket(fits: Callable[[int], bool | None], guess: int, limit: int) -> tuple[int, int]:
    """``(low, high)`` with ``low`` fitting (0 when nothing does) and ``high`` not (``limit + 1`` when all do).

    Steps away from ``guess`` in doubling strides: a close guess costs a replay or two. Stops early on a failed
    replay (the caller sees the failure).
    """
    step = 1
    if fits(guess):
        low = guess
        while low < limit:
            high = min(low + step, limit)
            if not fits(high):
                return low, high
            low, step = high, step * 2
        return limit, limit + 1
    high = guess
    while high > 1:
        low = max(high - step, 1)
        answer = fits(low)
        if answer is None or answer:
            return low, high
        high, step = low, step * 2
    return 0, 1
