"""Out-of-memory foreseen: before the first step on a CUDA device, replay it and warn when it cannot fit.

The first step is replayed under fake tensors with one uncounted warm-up step (so gradients and optimizer state
exist as they will from step 1 on). Memory already allocated (the model, the batch) is in the replay too, so what
the step still needs is the replayed peak minus what is allocated now; what it can have is the driver's free
memory plus the allocator's cached, unused blocks. Where the caching allocator is simulated (CUDA), the step fits
when the simulated allocator serves all of it (:func:`~lightning_vram.prediction.replay.serves.serve`) in the
memory it may hold: the driver's free memory plus all it reserves now; tensors that fit with the allocator's holes
around them do not. When it does not fit, each candidate change is replayed the same way and the warning lists
them, largest saving first; a change is offered as a fix only where the step with it is served (or, where nothing
is simulated, its tensor peak fits). Given the largest
shape the run expects (``max_shape``, or the shape ``max_length`` means), the first batch is replayed resized to it:
the check is for the largest batch, before it arrives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from lightning_vram.advice.catalogue import FULL_PRECISIONS, mixed_precision_for
from lightning_vram.measure.tensors import batch_size_of
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.replay.serves import Serving, serves_step
from lightning_vram.prediction.replay.simulation import Replays
from lightning_vram.records import (
    AllocatorReading,
    BatchSizeChange,
    FreeGradientsChange,
    Phase,
    PrecisionChange,
    PreflightRemedy,
    PreflightVerdict,
    ReplayedStep,
    StepChange,
    accumulation_text,
    keeping_global_batch,
)


def candidate_changes(
    precision: str, batch_size: int | None, compute_capability: tuple[int, int] | None, free_gradients: bool
) -> list[StepChange]:
    """The changes preflight tries on a CUDA device: 16-bit mixed precision, freed gradients, half the batch.

    ``free_gradients``: whether Lightning zeroes the gradients (:attr:`TrainingSetup.lightning_zeroes_gradients`); a
    step that zeroes its own may keep them across batches, and freeing them would discard them.
    """
    changes: list[StepChange] = []
    if precision in FULL_PRECISIONS:
        changes.append(PrecisionChange(mixed_precision_for("cuda", compute_capability)))
    if free_gradients:
        changes.append(FreeGradientsChange())
    if batch_size is not None and batch_size >= 2:
        changes.append(BatchSizeChange(batch_size // 2))
    return changes


def preflight(
    predictor: Replays,
    *,
    reading: AllocatorReading,
    free_bytes: int,
    changes: Sequence[StepChange],
    unseen_bytes: Mapping[Phase, int] | None = None,
    own_accumulation: bool = False,
) -> PreflightVerdict | str:
    """Replay the first step; the verdict, or why it could not be replayed.

    Raises only when a replay left something behind it could not take back
    (:class:`~lightning_vram.prediction.containment.containment.ContainmentError`,
    :class:`~lightning_vram.prediction.containment.escapes.ReplayEscapeError`): the caller turns replays off.

    Args:
        predictor: the first step (with a warm-up step, resized to the largest shape expected), within the replay
            budget: one replay running when it ends stops at its next op, and changes not reached in time are left
            out. Its allocator settings (``predictor.allocator``) are the simulated allocator's. A
            :class:`~lightning_vram.prediction.predictor.Predictor`, or one rank of a sharded run
            (:class:`~lightning_vram.prediction.strategies.rank_replays.RankReplays`: the rank's figures, tensor
            peaks only).
        reading: the allocator now (what is allocated and cached).
        free_bytes: the device's free memory now.
        changes: the changes to replay when the step does not fit.
        unseen_bytes: per phase, bytes the replay cannot see (the calibration's), held in the simulated allocator.
        own_accumulation: the run's own code accumulates the gradients (manual optimization, a plain or Fabric loop):
            a smaller batch's accumulation is then said as that code's, not ``accumulate_grad_batches``.
    """
    capacity = free_bytes + reading.reserved_bytes

    def serving(step: ReplayedStep) -> Serving | None:
        if predictor.allocator is None:
            return None
        return serves_step(step, capacity, predictor.allocator, unseen_bytes)

    with round_of_replays():
        replayed = predictor.replay()
        if not isinstance(replayed, ReplayedStep):
            return replayed.reason
        served = serving(replayed)
        verdict = PreflightVerdict(
            step=replayed,
            needed_bytes=max(replayed.peak.peak_bytes - reading.allocated_bytes, 0),
            available_bytes=free_bytes + max(reading.reserved_bytes - reading.allocated_bytes, 0),
            remedies=(),
            served=None if served is None else served.served,
            shortfall=None if served is None or served.shortfall is None else served.shortfall.text,
        )
        if verdict.fits:
            return verdict
        remedies: list[PreflightRemedy] = []
        for change in changes:
            if predictor.out_of_time():
                break
            result = predictor.replay(change)
            if isinstance(result, ReplayedStep) and result.peak.peak_bytes < replayed.peak.peak_bytes:
                with_it = serving(result)
                remedies.append(
                    PreflightRemedy(
                        change.label,
                        result.peak.peak_bytes,
                        reserved_peak_bytes=None if with_it is None else with_it.reserved_peak_bytes,
                        served=None if with_it is None else with_it.served,
                        accumulation=_keeping(
                            change, batch_size_of(predictor.batch), predictor.accumulate, own_accumulation
                        ),
                    )
                )
        remedies.sort(key=lambda remedy: remedy.peak_bytes)
        return replace(verdict, remedies=tuple(remedies))


def _keeping(change: StepChange, batch_size: int | None, accumulate: int, own_accumulation: bool) -> str | None:
    """For a smaller batch, the micro-batch and accumulation that keep the run's global batch; else ``None``.

    The global batch is ``batch_size`` times ``accumulate``; each micro-batch is at most the replayed one.
    ``own_accumulation``: as :func:`~lightning_vram.records.accumulation_text` takes it.
    """
    if not isinstance(change, BatchSizeChange) or batch_size is None:
        return None
    kept = keeping_global_batch(batch_size * accumulate, change.batch_size)
    return None if kept is None else accumulation_text(*kept, batch_size * accumulate, own_accumulation)


def replay_resized(predictor: Replays) -> ReplayedStep | str:
    """Replay the first step as ``predictor`` holds it (resized, after a warm-up step); or why it could not be.

    Where no free memory is known (the CPU): the prediction for the report's table of peaks per length. Raises what
    :func:`preflight` raises.
    """
    with round_of_replays():
        replayed = predictor.replay()
    return replayed if isinstance(replayed, ReplayedStep) else replayed.reason
