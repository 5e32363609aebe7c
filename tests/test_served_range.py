"""The fit table's answer is the largest batch with every batch from the run's to it served: serving is not
monotone in the batch size, and a bisection finds one boundary, not the first failure."""

from __future__ import annotations

import pytest
from test_synthesis import _fit_predictor, _replayed

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.replay import fit_table, served_range
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.prediction.replay.synthesis import AffineSteps
from lightning_vram.records import AllocationSequence, BatchSizeChange, ReplayedStep
from lightning_vram.records.advice import EXPANDABLE_MORE
from lightning_vram.records.advice_json import fit_row_from_dict, fit_row_to_dict
from lightning_vram.render.text import fit_assumption

MIB = 1024**2


def _scripted(unserved: set[int]) -> tuple[AllocationSequence | None, ...]:
    """Sequences by batch size (0 to 99): one request of 1 MiB, or of 3 MiB at the batches in ``unserved``."""
    return tuple((("malloc", 1, (3 if size in unserved else 1) * MIB, 0), ("free", 1, 0, 0)) for size in range(100))


def test_the_scan_takes_the_batch_below_the_lowest_failure_and_lists_the_gaps() -> None:
    sequences = _scripted({40, 41, 45, 70})
    found = served_range.served_range(sequences.__getitem__, AllocatorSettings(), 2 * MIB, 10, 60)
    assert (found.largest, found.found, found.unserved, found.checked_from) == (39, 60, ((40, 41), (45, 45)), 10)
    assert found.text == "served to 39; 40-41 and 45 not served (fragmentation), served again up to 60"
    whole = served_range.served_range(_scripted(set()).__getitem__, AllocatorSettings(), 2 * MIB, 10, 60)
    assert (whole.largest, whole.unserved, whole.text) == (60, (), None)


def test_a_range_longer_than_the_scans_budget_is_checked_from_the_top(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served_range, "SCAN_EVENTS", 20)  # ten batches of two events
    sequences = _scripted({5, 52})
    found = served_range.served_range(sequences.__getitem__, AllocatorSettings(), 2 * MIB, 1, 60)
    # 59 down to 50 served or not (52 is not, and costs nothing), 49 would pass the budget: 5 is never reached.
    assert (found.largest, found.unserved, found.checked_from) == (51, ((52, 52),), 49)


def test_an_answer_at_the_search_s_bound_is_not_scanned() -> None:
    asked: list[int] = []

    def sequences(size: int) -> AllocationSequence:
        asked.append(size)
        return (("malloc", 1, MIB, 0), ("free", 1, 0, 0))

    bound = served_range.MAX_BATCH_SIZE
    found = served_range.served_range(sequences, AllocatorSettings(), 2 * MIB, 8, bound)
    # The row says "at least" the bound: the batches just under it (none trains at) cost no row's budget.
    assert (found.largest, found.found, found.unserved, found.checked_from, asked) == (bound, bound, (), bound, [])
    below = served_range.served_range(sequences, AllocatorSettings(), 2 * MIB, bound - 3, bound - 1)
    assert (below.largest, below.checked_from, asked) == (bound - 1, bound - 3, [bound - 2, bound - 3])


def test_the_conv_batchnorm_row_is_the_largest_batch_below_the_first_one_not_served() -> None:
    predictor, own = _fit_predictor("conv-batchnorm")
    with round_of_replays():
        law = AffineSteps.fit(_replayed(predictor, 2 * own), 2 * own, _replayed(predictor, 3 * own), 3 * own)
        baseline = predictor.replay(BatchSizeChange(own))
        assert isinstance(baseline, ReplayedStep) and law is not None
        base = fit_table.phase_peaks(baseline, reserved=True)[0]
        context = 64 * MIB
        capacity = context + 9 * base
        search = predictor.fit_table(context, gpus=[("9x", capacity)])
    assert search.missing is None
    (row,) = search.found
    # The bisection alone reported 352: 337 to 341 are not served.
    assert (own, row.max_batch_size, row.expandable_max_batch_size) == (32, 336, 342)
    assert row.note == "served to 336; 337-341 not served (fragmentation), served again at 342-352"
    defaults = AllocatorSettings()
    assert all(serve(law.at(size) or (), defaults, capacity - context).served for size in range(own, 337))
    assert [serve(law.at(size) or (), defaults, capacity - context).served for size in range(336, 354)] == [
        True,
        *[False] * 5,
        *[True] * 11,
        False,
    ]
    assert fit_row_from_dict(fit_row_to_dict(row), "row") == row
    assert fit_assumption([row]).endswith(
        " 9x: served to 336; 337-341 not served (fragmentation), served again at 342-352. With"
        f" expandable_segments:True more on 9x (342 against 336): {EXPANDABLE_MORE}."
    )
