"""A live DDP rank predicted under ZeRO-2 and under FSDP full shard at the same world size (no collective).

A DDP rank's replays hold DDP's gradient buckets (the predictor's ``strategy``: :func:`~.ddp.holding`'s arithmetic
on the single-process step, allocated before it); ZeRO and FSDP hold no such copy of the gradients, so their
arithmetic runs on the single-process replay of the same module and batch, without the buckets: a copy of the
predictor sharing its walk, with no strategy and nothing carried from the sampled step (which held the buckets).
Its figures are :func:`~lightning_vram.prediction.strategies.predict_rank`'s on a plain
:class:`~lightning_vram.prediction.predictor.Predictor` of the module and batch (tests/test_sharding_stage.py).

The targets are what ``Trainer(strategy=...)`` makes of each name: ``deepspeed_stage_2`` with Lightning's
``DeepSpeedStrategy`` defaults (:data:`~.deepspeed.LIGHTNING_DEFAULTS`: 2e8-element buckets, ``overlap_comm``,
contiguous gradients), ``fsdp`` with ``FULL_SHARD`` and no wrap policy (the root the only unit). The lower of the
two is the trial's target; the saving starts from the rank's measured peak, buckets and all.
"""

from __future__ import annotations

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.prediction.strategies.ddp import ring_all_reduce_bytes
from lightning_vram.prediction.strategies.deepspeed import LIGHTNING_DEFAULTS, predict_zero
from lightning_vram.prediction.strategies.stronger import measured_peak
from lightning_vram.records import RankStep, ReplayedStep, ReplaySkipped, ShardingTrial, StrategySpec


def unbucketed(predictor: Predictor) -> Predictor:
    """A copy of ``predictor`` sharing its walk that replays the single-process step.

    No strategy buffers held, no sampled step's unseen bytes carried, no allocator peaks measured beside it.
    """
    single = predictor.sharing_walk()
    single.strategy = None
    single.carried = None
    single.measured = None
    return single


def targets(world_size: int) -> tuple[StrategySpec, StrategySpec]:
    """The sharded strategies a DDP run of ``world_size`` ranks is predicted under: ZeRO-2, FSDP full shard."""
    return StrategySpec("deepspeed_stage_2", world_size), StrategySpec("fsdp", world_size, sharding="FULL_SHARD")


def ddp_trial(
    predictor: Predictor, baseline: ReplayedStep, world_size: int, rank: int | None
) -> ShardingTrial | ReplaySkipped | None:
    """A DDP rank of ``world_size`` beside the lower of ZeRO-2 and FSDP full shard at the same world size.

    ``predictor`` is the run's, holding DDP's buckets (``strategy``) and calibrated by the sampled step;
    ``baseline`` its replay of that step (the model's figure for the rank under DDP); ``rank`` this rank (ZeRO-2's
    gradients crossing its partition's edges differ by rank; ``None``: the rank holding the most). ``None`` where
    the predictor holds no buckets or the run has one rank; a :class:`ReplaySkipped` where a target could not be
    predicted. Costs two replays of the step (host time only): one per target.
    """
    buckets = predictor.strategy
    if buckets is None or world_size < 2:
        return None
    single = unbucketed(predictor)
    predicted: list[RankStep] = []
    for spec in targets(world_size):
        step = (
            predict_zero(single, spec, None, LIGHTNING_DEFAULTS, rank)
            if spec.name == "deepspeed_stage_2"
            else predict_rank(single, spec)
        )
        if isinstance(step, ReplaySkipped):
            return step
        predicted.append(step)
    best = min(predicted, key=lambda step: (step.peak.peak_bytes, step.communication_bytes))
    other = next(step for step in predicted if step is not best)
    zero = best.spec.name == "deepspeed_stage_2"
    peak = baseline.peak
    return ShardingTrial(
        current="ddp",
        target=best.spec.name,
        world_size=world_size,
        offload=False,
        current_peak_bytes=peak.peak_bytes,
        current_phase=peak.phase,
        target_peak_bytes=best.peak.peak_bytes,
        target_phase=best.peak.phase,
        current_communication_bytes=ring_all_reduce_bytes(buckets.total_bytes, world_size),
        target_communication_bytes=best.communication_bytes,
        target_host_bytes=best.host_bytes,
        method=f"{best.method}; {other.spec.label} predicted at {other.peak.peak_bytes:,} bytes",
        target_sharding=best.spec.sharding,
        reduce_bucket_size=LIGHTNING_DEFAULTS.reduce_bucket_size if zero else None,
        allgather_bucket_size=LIGHTNING_DEFAULTS.allgather_bucket_size if zero else None,
        measured_peak_bytes=measured_peak(predictor),
    )
