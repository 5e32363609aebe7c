"""A live sharded rank that does not offload, predicted beside itself with CPU offload (no collective).

From the same single-process replay of the rank's step as its own prediction: ZeRO-1/2/3 with
``offload_optimizer`` to the CPU (ZeRO-Offload: the fp32 master partition, the optimizer's state and the gradient
partition on the host, :func:`~lightning_vram.prediction.strategies.deepspeed.offloaded`), and FSDP2 with its units
sharded again with ``CPUOffloadPolicy`` (the sharded parameters, their gradients and the state on the host,
:func:`~lightning_vram.prediction.strategies.fsdp2.offloaded`). A live FSDP1 rank is not offered offload: its offload
is not replayed on a live rank (:data:`~lightning_vram.prediction.strategies.fsdp1.LIVE_OFFLOAD_SKIP`). The saving
starts from the rank's measured peak, as :mod:`~lightning_vram.prediction.strategies.stronger`'s does.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import fsdp2
from lightning_vram.prediction.strategies.deepspeed import ZeroSettings, element_bytes, predict_zero
from lightning_vram.prediction.strategies.stronger import measured_peak, small_parameter_bytes
from lightning_vram.records import OffloadTrial, RankStep, ReplaySkipped, StrategySpec

OFFLOADABLE = ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp2")
"""The live strategies whose ranks are predicted with CPU offload."""


def offload_trial(
    predictor: Predictor,
    spec: StrategySpec,
    settings: ZeroSettings,
    rank: int,
    units: fsdp2.LiveUnits | None = None,
) -> OffloadTrial | ReplaySkipped | None:
    """Rank ``rank`` of ``spec`` as it runs and with CPU offload, from the same replay; the run's ``settings`` kept.

    ``units``: an FSDP2 run's units as it sharded them (sharded again offloading); ``None`` for ZeRO. ``None`` where
    ``spec`` offloads already or is not :data:`OFFLOADABLE`; a :class:`ReplaySkipped` where either could not be
    predicted. Costs two replays of the predictor's step (host time only).
    """
    if spec.offload or spec.name not in OFFLOADABLE or (spec.name == "fsdp2") != (units is not None):
        return None
    target = replace(spec, offload=True)
    steps: list[RankStep] = []
    for each in (spec, target):
        if units is not None:
            offloading = replace(units, units=tuple(replace(unit, offload=each.offload) for unit in units.units))
            predicted = fsdp2.predict(predictor, each, None, offloading)
        else:
            predicted = predict_zero(predictor, each, None, settings, rank)
        if isinstance(predicted, ReplaySkipped):
            return predicted
        steps.append(predicted)
    now, then = steps
    zero = units is None
    return OffloadTrial(
        strategy=spec.name,
        world_size=spec.world_size,
        sharding=spec.sharding,
        current_peak_bytes=now.peak.peak_bytes,
        target_peak_bytes=then.peak.peak_bytes,
        target_phase=then.peak.phase,
        host_bytes=then.host_bytes,
        transfer_bytes=then.host_transfer_bytes,
        method=then.method,
        reduce_bucket_size=settings.reduce_bucket_size if zero else None,
        allgather_bucket_size=settings.allgather_bucket_size if zero else None,
        measured_peak_bytes=measured_peak(predictor),
        small_parameter_bytes=(
            small_parameter_bytes(predictor.module, element_bytes(predictor.precision))
            if spec.name == "deepspeed_stage_3"
            else 0
        ),
    )
