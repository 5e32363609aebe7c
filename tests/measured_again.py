"""A gloo ground-truth run measured once more where its figures miss the prediction: the second run's misses.

A rank's measured peak varies from run to run, every counted part the same: now and then one rank holds one tensor
more (FSDP2's optimizer step on a GPT-2-like model: 264,712 bytes on one rank, in two fresh-clone runs of the suite
out of four; ZeRO-2's optimizer peak on rank 2 of 4: 697,008 bytes for 624,800, on this machine and on the CI's). The
cause: gloo's worker thread holds a finished collective's tensors until it gets the GIL to let go of them, after the
rank's code has dropped them (docs/measurement.md, "Why a gloo rank's live peak varies from run to run";
scripts/gloo_late_release.py). A figure must match the prediction in one of two runs: both missing it fails the test.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

Ranks = TypeVar("Ranks")
Miss = TypeVar("Miss")


def measured_again_where_missed(
    out: Path,
    measure: Callable[[Path], Ranks],
    misses_of: Callable[[Ranks], list[Miss]],
    key: Callable[[Miss], Hashable],
) -> list[Miss]:
    """``misses_of`` a run ``measure`` makes in ``out``; where it misses, the second run's (in ``out / "again"``)
    misses of the same figure (``key``: which rank, phase and part a miss is of) as the first's.

    Each figure must match the prediction in one run of two at least: the excess falls on one figure or another
    from run to run (in one run ZeRO-1's optimizer peak on rank 2 of 4, in the next ZeRO-3's backward peak on rank 1).
    """
    misses = misses_of(measure(out))
    if misses:
        print(f"measured again: the first run missed {misses}")
        again = out / "again"
        again.mkdir()
        first = {key(miss) for miss in misses}
        misses = [miss for miss in misses_of(measure(again)) if key(miss) in first]
    return misses
