"""Every batch from the run's to the fit table's answer served, checked one by one on synthesized sequences.

Whether the simulated allocator serves a step is not monotone in the batch size: a segment size that changes class
(a request crossing the 10 MiB that gets it a 20 MiB segment, a rest crossing the 1 MiB that splits a block) can
leave a few batches unserved between served ones (the conv/BatchNorm test model at 9 times its reserved peak: served
to 336, not at 337 to 341, served again from 342 to 352). A bisection finds one boundary, not the first failure, and
a user may train at any batch up to the answer: so the answer is scanned down to the run's batch, every batch
served (``~0.3 ms`` a batch for a 74-event step, ``~4 ms`` for 659 events, here), and the largest batch is the one
below the lowest failure. The scan holds at most :data:`SCAN_EVENTS` events; where the range is longer, the top of it
(where the step is nearest the card's memory) is scanned and :attr:`ServedRange.checked_from` says from where. An
answer at the search's bound (:data:`~lightning_vram.prediction.replay.search.MAX_BATCH_SIZE`: the row says "at least")
is not scanned: the card never ran short below it, and a scan there would check the batches just under the bound,
which no one trains at, at the price of a whole row's budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.calibration import unseen_at
from lightning_vram.prediction.replay.search import MAX_BATCH_SIZE
from lightning_vram.prediction.replay.serves import ServingMemo
from lightning_vram.records import AllocationSequence, Phase

SCAN_EVENTS = 50_000
"""Most allocator events (mallocs, frees and phase marks, over all batches) one row's scan runs through the model:
about 0.2 s at the model's 3-4 µs an event as first measured (about 1.3 times less since), unloaded, 3 s for a fit
table's 14 rows and settings. Every batch of a range whose sequences fit it is checked (docs/allocator-model.md
weighs the budget)."""


@dataclass(frozen=True)
class ServedRange:
    """The batches a row's answer stands on.

    ``largest``: the largest batch with every batch from ``checked_from`` to it served; ``found``: the bisection's
    answer (served, the next not); ``unserved``: the runs of batches (first, last) not served between ``largest``
    and ``found``, lowest first; ``checked_from``: the lowest batch checked one by one (the run's batch where the
    scan covered the whole range).
    """

    largest: int
    found: int
    unserved: tuple[tuple[int, int], ...]
    checked_from: int

    @property
    def text(self) -> str | None:
        """Where the served batches have a gap, one line; ``None`` where they have none.

        >>> ServedRange(336, 352, ((337, 341),), 32).text
        'served to 336; 337-341 not served (fragmentation), served again at 342-352'
        >>> ServedRange(336, 352, ((337, 337), (340, 341)), 32).text
        'served to 336; 337 and 340-341 not served (fragmentation), served again up to 352'
        """
        if not self.unserved:
            return None
        runs = [str(first) if first == last else f"{first}-{last}" for first, last in self.unserved]
        last_gap = self.unserved[-1][1]
        again = f"at {last_gap + 1}-{self.found}" if len(runs) == 1 else f"up to {self.found}"
        if last_gap + 1 == self.found and len(runs) == 1:
            again = f"at {self.found}"
        return f"served to {self.largest}; {' and '.join(runs)} not served (fragmentation), served again {again}"


def served_range(
    synthesized: Callable[[int], AllocationSequence | None],
    settings: AllocatorSettings,
    capacity_bytes: int,
    start: int,
    found: int,
    unseen_bytes: Mapping[Phase, int] | None = None,
    memo: ServingMemo | None = None,
) -> ServedRange:
    """The largest batch with every batch from ``start`` (the run's) to it served at ``capacity_bytes``.

    ``synthesized``: a batch's allocation sequence (``None`` where it has none: counted as not served); ``found``:
    a batch the bisection found served; ``unseen_bytes``: measured at ``start``, carried in proportion above it
    (:func:`unseen_at`). Scans down from ``found`` to ``start`` (1 where ``found`` is below it) while
    :data:`SCAN_EVENTS` allows; not at all where ``found`` is the search's bound (the module's docstring).
    ``memo``: the search's servings (a batch served or not there already is not simulated again; default: the scan's
    own).
    """
    servings = ServingMemo() if memo is None else memo
    if found >= MAX_BATCH_SIZE:
        return ServedRange(found, found, (), found)
    low = start if start <= found else 1
    unserved: list[int] = []
    events = 0
    checked_from = found
    for size in range(found - 1, low - 1, -1):
        sequence = synthesized(size)
        if sequence is not None and events + len(sequence) > SCAN_EVENTS:
            break
        checked_from = size
        if sequence is None:
            unserved.append(size)
            continue
        unseen = unseen_at(unseen_bytes or {}, start, size)
        if not servings.serve(size, sequence, settings, capacity_bytes, unseen).served:
            unserved.append(size)
            continue
        events += len(sequence)
    largest = unserved[-1] - 1 if unserved else found
    return ServedRange(largest, found, _runs(sorted(unserved)), checked_from)


def _runs(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    """Consecutive batch sizes as (first, last) runs, in order.

    >>> _runs([3, 4, 5, 9, 11, 12])
    ((3, 5), (9, 9), (11, 12))
    """
    runs: list[tuple[int, int]] = []
    for size in sizes:
        if runs and runs[-1][1] == size - 1:
            runs[-1] = (runs[-1][0], size)
        else:
            runs.append((size, size))
    return tuple(runs)
