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

import dataclasses
import os

from torch.nn.parameter import UninitializedParameter

from lightning_vram.measure.ddp import DEFAULT_BUCKET_BYTES, bucket_sizes, reduced_parameters
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.precision import precision_plan
from lightning_vram.prediction.replay.reserved import phase_peaks
from lightning_vram.prediction.replay.storages import allocator_bytes
from lightning_vram.records import (
    AllocationSequence,
    Phase,
    PhasePeak,
    PrecisionChange,
    RankLine,
    RankStep,
    ReplayedStep,
    ReplaySkipped,
    StepChange,
    StrategyBuffers,
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
    return (RankLine("NCCL buffers", 2 * size, basis, outside_allocator=True),)


BUCKET_BLOCKS = -(1 << 41)
"""The first block id of the buckets put in a replay's allocation sequence (counting down: storages take positive
ids, workspaces small negative ones, a phase's unseen bytes ``-(1 << 40)``)."""


def holding(replayed: ReplayedStep, buffers: StrategyBuffers, allocator: AllocatorSettings | None) -> ReplayedStep:
    """``replayed`` with ``buffers`` alive for the whole step, as a replay holding them from its start counts it.

    Every phase's peak and ``other`` grow by the buffers' bytes (in the allocator's 512-byte blocks on CUDA), the
    timeline's ``other`` too; the allocation sequence gets their allocations at its start, and the reserved peaks
    are the allocator model's (``allocator``) on it. The single-process replay plus this is the replay of the same
    step holding them (the phases to the byte; a timeline point whose ``other`` was clamped at 0 may be up to the
    buffers' bytes above), so one replay serves every world size.
    """
    held = sum(allocator_bytes(size) if replayed.device_type == "cuda" else size for size in buffers.buffers)
    allocations = replayed.allocations
    reserved: dict[Phase, int] = {}
    if allocations is not None:
        allocations = with_buffers(allocations, buffers.buffers)
        if allocator is not None:
            reserved = phase_peaks(allocations, allocator)
    timeline = replayed.timeline
    if timeline is not None:
        points = tuple(dataclasses.replace(point, other=point.other + held) for point in timeline.points)
        timeline = dataclasses.replace(timeline, points=points)
    return dataclasses.replace(
        replayed,
        phases=_shifted(replayed.phases, held, reserved),
        timeline=timeline,
        allocations=allocations,
        strategy=buffers,
        window_first=None if replayed.window_first is None else _shifted(replayed.window_first, held, {}),
    )


def _shifted(phases: dict[Phase, PhasePeak], held: int, reserved: dict[Phase, int]) -> dict[Phase, PhasePeak]:
    """Each phase's peak and ``other`` ``held`` bytes higher; its reserved peak from ``reserved`` where given."""
    return {
        phase: dataclasses.replace(
            peak,
            peak_bytes=peak.peak_bytes + held,
            reserved_bytes=reserved.get(phase, peak.reserved_bytes),
            breakdown=None if peak.breakdown is None else peak.breakdown.with_measured_peak(peak.peak_bytes + held),
        )
        for phase, peak in phases.items()
    }


def with_buffers(allocations: AllocationSequence, buffers: tuple[int, ...]) -> AllocationSequence:
    """``allocations`` with each of ``buffers`` (bytes) allocated at its start and never freed."""
    held = tuple(("malloc", BUCKET_BLOCKS - index, size, 0) for index, size in enumerate(buffers) if size > 0)
    return (*held, *allocations)


LAZY_SKIP = (
    "DDP: the module has uninitialized (lazy) parameters, which DistributedDataParallel cannot wrap: run a forward"
    " on a batch first to make them"
)
"""Why DDP's rank is not predicted for a module with lazy parameters (``nn.LazyLinear`` before its first forward)."""


def predict(predictor: Predictor, spec: StrategySpec, change: StepChange | None) -> RankStep | ReplaySkipped:
    """One DDP rank of ``spec.world_size``: the replay of the predictor's (per-rank) batch holding DDP's buckets.

    The single-process replay with the buckets added by :func:`holding` (what a replay holding them counts).
    """
    precision = change.precision if isinstance(change, PrecisionChange) else predictor.precision
    try:
        dtype = precision_plan(precision).true_dtype
    except ValueError as error:
        return ReplaySkipped(str(error))
    parameters = reduced_parameters(predictor.module)
    if any(isinstance(parameter, UninitializedParameter) for parameter in parameters):
        return ReplaySkipped(LAZY_SKIP)
    buckets = bucket_sizes(parameters, DEFAULT_BUCKET_BYTES, dtype)
    single = predictor.replay(change)  # the single-process step: the same replay at every world size
    if isinstance(single, ReplaySkipped):
        return single
    replayed = holding(single, buckets, predictor.allocator)
    lines = (
        RankLine(f"{buckets.label} ({len(buckets.buffers)})", buckets.total_bytes, buckets.basis),
        *nccl_line(spec.world_size, predictor.device_type),
    )
    sent = ring_all_reduce_bytes(buckets.total_bytes, spec.world_size)
    return RankStep(spec, replayed.phases, lines, sent, METHOD, replayed.notes, replayed, replayed.window_first)
