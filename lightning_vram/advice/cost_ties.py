"""Which priced checkpointing plans recompute alike: where the run's timing must not choose between them.

A plan's recomputation is priced in predicted seconds from the host's peaks, measured in the running process
(:mod:`~lightning_vram.prediction.timing.host`), so the figures move with the machine's load: a trial's demo advised
``features`` in 2 segments on a loaded machine and in 3 on a quiet one, both recomputing ``features[0:4]``, their
predicted times equal but for the order their ops were summed in. Plans whose recomputed work is the same (the same
recomputed FLOPs and bytes moved), or whose predicted times are within :data:`COST_TOLERANCE` of the least, are
alike: the caller orders them by what the timing cannot change: the recomputed work as counted
(:func:`counted_work`), then the replayed saving or peak, the units, the order. The count comes first so that a plan
recomputing more does not win by a sliver of saving on the runs where the load brings it within the tolerance (a
ResNet's stem with its three blocks, 512 B more saved for a BatchNorm and a ReLU more recomputed, advised or not by the
machine's load). Plans priced in FLOPs (no device peaks) are counted, not timed: only the same count is alike.
"""

from __future__ import annotations

from collections.abc import Sequence

COST_TOLERANCE = 0.05
"""A predicted recomputation time within this share of the least is as cheap as the least. The host's measured peaks
move more than this under load (a trial's ViT, ``predict(memory_budget=...)`` in eight processes, step time predicted
0.138 to 1.216 s), and a recomputation 5% dearer is a smaller share of the step still."""

Work = tuple[int, int]
"""A plan's recomputed FLOPs and bytes moved."""


def least_alike(costs: Sequence[float], work: Sequence[Work | None], seconds: bool) -> frozenset[int]:
    """The indices of the plans as cheap as the cheapest: its recomputed work, or (``seconds``) within tolerance.

    ``costs``: each plan's recomputation, in predicted seconds where ``seconds``, else in FLOPs; ``work``: its
    recomputed FLOPs and bytes moved (``None``: not counted).

    >>> sorted(least_alike([0.0100000001, 0.01, 0.0104, 0.02], [(5, 9), (5, 9), (7, 9), (9, 9)], True))
    [0, 1, 2]
    >>> sorted(least_alike([2.0, 2.0, 3.0], [None, None, None], False))
    [0, 1]
    """
    if not costs:
        return frozenset()
    least = min(range(len(costs)), key=costs.__getitem__)
    reach = costs[least] * (1 + COST_TOLERANCE) if seconds else costs[least]
    return frozenset(
        index
        for index, cost in enumerate(costs)
        if cost <= reach or (work[index] is not None and work[index] == work[least])
    )


def counted_work(work: Work | None) -> Work:
    """The order of a plan's recomputed work among plans alike in cost: its FLOPs, then its bytes moved.

    ``None`` (not counted) orders as no work: plans are counted all or none (the replays of one run).

    >>> sorted([(9, 9), None, (5, 10), (5, 9)], key=counted_work)
    [None, (5, 9), (5, 10), (9, 9)]
    """
    return work if work is not None else (0, 0)
