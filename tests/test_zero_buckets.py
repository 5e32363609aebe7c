"""ZeRO-1/2's backward op by op (``_zero_buckets``): each rank's partition buffer from its first bucket reduce."""

from __future__ import annotations

import pytest

from lightning_vram.prediction.strategies._zero_buckets import BucketModel
from lightning_vram.records import Phase, StepTimeline, TimelinePoint

# Three parameters of 5 elements (fp32), one per rank's partition, in 6-element buckets: their gradients come last
# first, and each fills a bucket of its own, reduced when the next arrives (rank 2's when the second comes, rank 1's
# when the third does, rank 0's as backward ends). Activations and temporaries: 100, 90, 95, 10 bytes at the points.
POINTS = [(0, 100), (20, 90), (40, 95), (60, 10)]
TIMELINE = StepTimeline(
    tuple(
        TimelinePoint(op, Phase.BACKWARD, 60, gradients, 0, activations, 0)
        for op, (gradients, activations) in enumerate(POINTS)
    ),
    len(POINTS),
    ((Phase.BACKWARD, 0),),
    0,
    None,
    None,
)


def model(stage: int, accumulating: bool, cpu: bool) -> BucketModel:
    """The three parameters' model at world size 3, 4-byte elements in ZeRO and in the replay."""
    return BucketModel([[5, 5, 5]], [5], 6, 4, 4, stage=stage, accumulating=accumulating, cpu=cpu)


@pytest.mark.parametrize(
    ("stage", "accumulating", "cpu", "peaks"),
    [
        # both buckets (48 bytes); rank 2's buffer (20) from the third point on: 95 + 48 + 20 there
        (2, False, True, [148, 148, 163]),
        (1, False, True, [148, 148, 163]),
        (2, True, True, [148, 148, 163]),
        # CUDA counts the previous micro-batch's buffer ZeRO-2 keeps in all_grad_tensors, every rank's own
        (2, True, False, [168, 168, 183]),
        # ZeRO-1 accumulating: the whole gradients not yet moved (60 bytes at the start), one bucket seen on the CPU
        # until the first reduce (both on CUDA)
        (1, True, True, [184, 184, 184]),
        (1, True, False, [208, 208, 208]),
    ],
)
def test_each_rank_holds_its_buffer_from_its_first_reduce(
    stage: int, accumulating: bool, cpu: bool, peaks: list[int]
) -> None:
    assert [model(stage, accumulating, cpu).peak(TIMELINE, rank) for rank in range(3)] == peaks
