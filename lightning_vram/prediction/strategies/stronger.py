"""The next stronger sharding of a live run's strategy, predicted for this rank beside its own (no collective).

ZeRO-1 grows to ZeRO-2 (the gradients partitioned too), ZeRO-2 to ZeRO-3 (the parameters too), each at the same
world size, with the run's bucket settings and offload kept. Both strategies are the per-rank model's arithmetic on
the one single-process replay of the rank's step (:func:`~lightning_vram.prediction.strategies.deepspeed.predict_zero`),
and the rank's measured peak beside them: the advice's saving is the measured peak less the stronger stage's
predicted one, so the model's error on the run's own strategy (ZeRO-1/2's backward peak, up to 15% off on one rank,
tests/test_rank_prediction_zero.py) does not enter it.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies.deepspeed import ZeroSettings, element_bytes, predict_zero
from lightning_vram.records import RankStep, ReplaySkipped, ShardingTrial, StrategySpec
from lightning_vram.records.simulation import PERSISTENCE_THRESHOLD

STRONGER = {"deepspeed_stage_1": "deepspeed_stage_2", "deepspeed_stage_2": "deepspeed_stage_3"}
"""Each ZeRO stage's next stronger one: what it shards beyond the run's."""


def stronger(spec: StrategySpec) -> StrategySpec | None:
    """``spec``'s next stronger sharding at the same world size, offload kept; ``None`` where there is none modelled.

    >>> stronger(StrategySpec("deepspeed_stage_2", 8, offload=True)).label
    'deepspeed_stage_3 x8 offload'
    >>> stronger(StrategySpec("deepspeed_stage_3", 8)) is None
    True
    """
    target = STRONGER.get(spec.name)
    return None if target is None else replace(spec, name=target)


def small_parameter_bytes(module: nn.Module, element: int) -> int:
    """Bytes of the trained parameters of at most :data:`PERSISTENCE_THRESHOLD` elements, at ``element`` bytes each.

    What DeepSpeed's default ``param_persistence_threshold`` keeps whole on every ZeRO-3 rank once gathered
    (``mark_persistent_parameters``, DeepSpeed 0.19), where the per-rank model partitions every parameter.
    """
    seen: set[int] = set()
    total = 0
    for parameter in module.parameters():
        if parameter.requires_grad and id(parameter) not in seen and parameter.numel() <= PERSISTENCE_THRESHOLD:
            seen.add(id(parameter))
            total += parameter.numel() * element
    return total


def measured_peak(predictor: Predictor) -> int | None:
    """The rank's measured peak on the sampled step the predictor is calibrated by, in bytes.

    The highest phase's; ``None`` where the calibration did not measure every phase's peak (or there is none), and
    under gradient accumulation where the sampled step is not the micro-batch the prediction is of (the window's
    stepping one): a trial's DDP run sampled a window's first micro-batch, 25.5 MiB with no gradients held yet, and
    its advice started from it where the run's peak, the window's second, was 27.0 MiB.
    """
    sampled = predictor.calibration
    if sampled is None or not sampled.phases or any(part.other is None for part in sampled.phases.values()):
        return None
    if predictor.accumulate > 1 and sampled.micro_batch != predictor.accumulate:
        return None
    return max(part.peak_bytes for part in sampled.phases.values())


def sharding_trial(
    predictor: Predictor, spec: StrategySpec, settings: ZeroSettings, rank: int
) -> ShardingTrial | ReplaySkipped | None:
    """Rank ``rank`` of ``spec`` (ZeRO-1/2, with the run's ``settings``) beside the next stronger stage.

    The predictor's calibration (the sampled step's counts, where it measured every phase's peak) gives the rank's
    measured peak, which the saving starts from.

    ``None`` where ``spec`` has no stronger stage modelled; a :class:`ReplaySkipped` where either could not be
    predicted. Costs two replays of the predictor's step (host time only).
    """
    target = stronger(spec)
    if target is None:
        return None
    steps: list[RankStep] = []
    for each in (spec, target):
        predicted = predict_zero(predictor, each, None, settings, rank)
        if isinstance(predicted, ReplaySkipped):
            return predicted
        steps.append(predicted)
    now, then = steps
    small = small_parameter_bytes(predictor.module, element_bytes(predictor.precision))
    return ShardingTrial(
        current=spec.name,
        target=target.name,
        world_size=spec.world_size,
        offload=spec.offload,
        current_peak_bytes=now.peak.peak_bytes,
        current_phase=now.peak.phase,
        target_peak_bytes=then.peak.peak_bytes,
        target_phase=then.peak.phase,
        current_communication_bytes=now.communication_bytes,
        target_communication_bytes=then.communication_bytes,
        target_host_bytes=then.host_bytes,
        method=then.method,
        reduce_bucket_size=settings.reduce_bucket_size,
        allgather_bucket_size=settings.allgather_bucket_size,
        small_parameter_bytes=small if target.name == "deepspeed_stage_3" else 0,
        measured_peak_bytes=measured_peak(predictor),
    )
