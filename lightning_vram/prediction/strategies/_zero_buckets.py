"""ZeRO-1/2's backward, op by op: the reduce buckets DeepSpeed fills, and when each rank's partition buffer appears.

DeepSpeed 0.19 (``contiguous_gradients``, ``overlap_comm``) copies each gradient, as its hook fires, into a reduce
bucket of ``reduce_bucket_size`` elements (two, used in turn) and frees it; when the next gradient would overflow the
bucket, the bucket is reduced, and each parameter of it that overlaps this rank's partition is copied into
``grads_in_partition``: one buffer of the whole of every such parameter (``copy_grads_in_partition``), allocated at
the first such copy and held to the end of backward. So a rank's backward peak depends on when that first copy
comes: a rank whose partition holds the last parameters (their gradients come first) allocates it while most
activations are still saved, a rank holding the first ones late in backward. Measured on gloo
(tests/test_rank_prediction_zero.py, world size 4): ranks 2 and 3 hold 99,328 and 69,928 bytes from the first reduce
on (1,043,828 and 1,014,428 bytes at the peak); ranks 0 and 1 allocate theirs after the peak (979,060).

Under accumulation ZeRO-1 keeps every whole gradient until the window's last micro-batch (``param.grad``, added to in
place), whose hooks move them into the buckets one by one; the buckets themselves were allocated in an earlier
micro-batch, and the live count sees each when it is first written (the second after the first reduce).
ZeRO-2 reduces every micro-batch, holding the sums in a list the monitor does not count (``all_grad_tensors``): its
later micro-batches hold, as counted, what the first does.

The order in which gradients appear is read from the single-process replay of a micro-batch whose gradients start
from ``None`` (the step without accumulation, the window's first with it): each rise of the timeline's gradients is a
parameter's gradient made, matched to the parameters in reverse order (the first of that size still waiting).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_vram.records import Phase, StepTimeline


@dataclass(frozen=True)
class Flat:
    """Where a parameter sits in ZeRO-1/2's flat buffers: its param group, its first element there, its elements."""

    group: int
    offset: int
    numel: int


def flat_layout(groups: Sequence[Sequence[int]]) -> list[Flat]:
    """Every parameter of ``groups`` (each group's sizes, in elements, in order), in that order, with its place.

    >>> [(f.group, f.offset) for f in flat_layout([[3, 4], [5]])]
    [(0, 0), (0, 3), (1, 0)]
    """
    return [
        Flat(group, offset, numel)
        for group, numels in enumerate(groups)
        for offset, numel in zip(itertools.accumulate(numels, initial=0), numels, strict=False)
    ]


def readiness(points: Sequence[tuple[int, int]], numels: Sequence[int], element: int) -> tuple[list[int], list[int]]:
    """The order the parameters' gradients appear in, and how many have appeared at each of ``points``.

    ``points``: (gradient bytes alive, op) over backward, in op order; ``numels``: each parameter's elements;
    ``element``: bytes of a gradient element in the replay. Each rise is matched to the parameters still waiting, last
    first: the first of exactly that size, else as many as cover it. Those never seen come last.

    >>> readiness([(0, 1), (40, 2), (40, 3), (48, 4)], [2, 10, 3], 4)
    ([1, 0, 2], [0, 1, 1, 2])
    """
    waiting = list(reversed(range(len(numels))))
    order: list[int] = []
    counts = []
    previous = points[0][0] if points else 0
    for gradients, _ in points:
        rise = (gradients - previous) // element
        previous = gradients
        while rise > 0 and waiting:
            index = next((i for i in waiting if numels[i] == rise), waiting[0])
            waiting.remove(index)
            order.append(index)
            rise -= numels[index]
        counts.append(len(order))
    return order + waiting, counts


def reduces(order: Sequence[int], numels: Sequence[int], bucket: int) -> list[tuple[int | None, list[int]]]:
    """Each bucket reduce: how many gradients have appeared when it runs (``None``: backward's end), and its params.

    >>> reduces([2, 1, 0], [5, 5, 5], 10)
    [(3, [2, 1]), (None, [0])]
    """
    done: list[tuple[int | None, list[int]]] = []
    filling: list[int] = []
    elements = 0
    for count, index in enumerate(order, start=1):
        if filling and elements + numels[index] > bucket:
            done.append((count, filling))
            filling, elements = [], 0
        filling.append(index)
        elements += numels[index]
    done.append((None, filling))
    return done


def partition_params(layout: Sequence[Flat], shares: Sequence[int], rank: int) -> set[int]:
    """The parameters overlapping rank ``rank``'s partition of their group (``shares``: each group's, in elements)."""
    return {
        index
        for index, place in enumerate(layout)
        if place.offset < (rank + 1) * shares[place.group] and place.offset + place.numel > rank * shares[place.group]
    }


@dataclass(frozen=True)
class BucketModel:
    """What ZeRO-1/2 holds in backward beside the parameters and the optimizer state, in bytes.

    ``bucket_elements``: one reduce bucket; ``element``: a gradient element under ZeRO, ``replay_element``: in the
    replay; ``stage``: 1 or 2; ``accumulating``: a window's later micro-batch; ``cpu``: counted by the CPU's live
    count, which sees only what it registered or saw made in the step (CUDA's allocator counts every allocation).

    Accumulating, ZeRO-1 holds every whole gradient until its hook, its buckets made in an earlier micro-batch (on
    the CPU each counted once first written: the second after the first reduce); ZeRO-2 holds the previous
    micro-batch's partition buffer in ``all_grad_tensors`` (not seen on the CPU). What CUDA counts there follows
    DeepSpeed's source and is not yet checked on a GPU.
    """

    groups: Sequence[Sequence[int]]
    shares: Sequence[int]
    bucket_elements: int
    element: int
    replay_element: int
    stage: int
    accumulating: bool
    cpu: bool

    def peak(self, timeline: StepTimeline, rank: int) -> int | None:
        """The most rank ``rank`` holds over ``timeline``'s backward beyond parameters and state, in bytes.

        At each point: the replay's activations and temporaries, the buckets seen, the whole gradients held (ZeRO-1
        accumulating), the partition buffer carried (ZeRO-2 accumulating, on CUDA) and, from the rank's first reduce
        on, its partition buffer. ``None``: no backward in it.
        """
        points = [point for point in timeline.points if point.phase is Phase.BACKWARD]
        if not points:
            return None
        layout = flat_layout(self.groups)
        numels = [place.numel for place in layout]
        order, counts = readiness([(p.gradients, p.op) for p in points], numels, self.replay_element)
        done = reduces(order, numels, self.bucket_elements)
        mine = partition_params(layout, self.shares, rank)
        partition = sum(numels[index] for index in mine) * self.element
        first = next(count for count, params in done if mine.intersection(params)) if mine else None
        first_reduce = done[0][0]
        total = sum(numels)
        ready = list(itertools.accumulate((numels[index] for index in order), initial=0))
        bucket = self.bucket_elements * self.element
        held_whole = self.accumulating and self.stage == 1
        carried = partition if self.accumulating and self.stage == 2 and not self.cpu else 0
        highest = 0
        for point, count in zip(points, counts, strict=True):
            held = (total - ready[count]) * self.element if held_whole else 0
            seen = 1 + (first_reduce is not None and count >= first_reduce) if held_whole and self.cpu else 2
            buffer = partition if first is not None and count >= first else 0
            highest = max(highest, point.activations + point.other + seen * bucket + held + buffer + carried)
        if mine and first is None:  # the last reduce, as backward ends
            highest = max(highest, points[-1].activations + points[-1].other + 2 * bucket + partition + carried)
        return highest
