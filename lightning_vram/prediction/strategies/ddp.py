"""DDP's rank at any world size: the single-process replay of one rank's batch, holding DDP's gradient buckets.

A DDP rank runs the module's own step on its batch; beyond it the Reducer holds its buckets, a second copy of every
reduced gradient for the whole run (:mod:`lightning_vram.measure.ddp`), whatever the world size. At world size 1
too: torch 2.13's ``DistributedDataParallel.__init__`` builds its Reducer without looking at the world size (a
one-rank gloo group's Reducer holds one bucket of every gradient's bytes). The gradients are all-reduced
in a ring: each rank sends ``2 (N - 1) / N`` of the buckets' bytes per optimizer step. Under gradient accumulation
Lightning runs a window's earlier micro-batches in ``no_sync()``: the gradients add up in ``param.grad``, the buckets
stay allocated, and the all-reduce runs once, on the window's last micro-batch (the replay's window as it is).
"""

from __future__ import annotations

import os

from lightning_vram.measure.ddp import DEFAULT_BUCKET_BYTES, bucket_sizes, reduced_parameters
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.precision import precision_plan
from lightning_vram.records import (
    PrecisionChange,
    RankLine,
    RankStep,
    ReplaySkipped,
    StepChange,
    StrategySpec,
)

METHOD = (
    "arithmetic on the single-process replay: DDP's Reducer holds a second copy of every gradient in buckets"
    " (gradient_as_bucket_view=False, bucket_cap_mb=25), allocated before the step and held in every phase; ring"
    " all-reduce sends 2(N-1)/N of them per step"
)
"""How a DDP rank is predicted."""
NCCL_BUFFER_BYTES = 4 * 1024 * 1024
"""NCCL's ``NCCL_BUFFSIZE`` default: one channel's Simple-protocol buffer to one peer, in bytes."""


def ring_all_reduce_bytes(total_bytes: int, world_size: int) -> int:
    """Bytes each rank sends to all-reduce ``total_bytes`` in a ring of ``world_size`` ranks: ``2 (N - 1) / N``.

    >>> ring_all_reduce_bytes(1000, 4)
    1500
    """
    return 2 * (world_size - 1) * total_bytes // world_size


def nccl_line(world_size: int, device_type: str) -> tuple[RankLine, ...]:
    """NCCL's own buffers on a CUDA rank of a group of several, as a lower bound (none elsewhere).

    NCCL allocates them outside torch's caching allocator (so they are in no phase's peak): per channel, a buffer of
    ``NCCL_BUFFSIZE`` (4 MiB by default) to each of a ring's two neighbours; NCCL opens more channels on NVLink and
    InfiniBand, and the LL and LL128 protocols' buffers beside them, so this is one channel's, the least it holds.
    """
    if device_type != "cuda" or world_size == 1:
        return ()
    size = int(os.environ.get("NCCL_BUFFSIZE", NCCL_BUFFER_BYTES))
    basis = (
        f"lower bound: one ring channel's Simple-protocol buffers to its two neighbours, 2 x NCCL_BUFFSIZE ({size});"
        " outside torch's allocator, not in the phases' peaks"
    )
    return (RankLine("NCCL buffers", 2 * size, basis),)


def predict(predictor: Predictor, spec: StrategySpec, change: StepChange | None) -> RankStep | ReplaySkipped:
    """One DDP rank of ``spec.world_size``: the replay of the predictor's (per-rank) batch holding DDP's buckets."""
    precision = change.precision if isinstance(change, PrecisionChange) else predictor.precision
    try:
        dtype = precision_plan(precision).true_dtype
    except ValueError as error:
        return ReplaySkipped(str(error))
    buckets = bucket_sizes(reduced_parameters(predictor.module), DEFAULT_BUCKET_BYTES, dtype)
    holding = predictor.sharing_walk()  # the same round (its walk, budget, calibration), holding the buckets
    holding.strategy = buckets
    replayed = holding.replay(change)
    if isinstance(replayed, ReplaySkipped):
        return replayed
    lines = (
        RankLine(f"{buckets.label} ({len(buckets.buffers)})", buckets.total_bytes, buckets.basis),
        *nccl_line(spec.world_size, predictor.device_type),
    )
    sent = ring_all_reduce_bytes(buckets.total_bytes, spec.world_size)
    return RankStep(spec, replayed.phases, lines, sent, METHOD, replayed.notes, replayed, replayed.window_first)
