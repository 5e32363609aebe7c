"""The replay of a run's sampled step and of the changes the rules declared, and the batch-size search.

The changes are the union of those every rule declares
(:func:`~lightning_vram.advice.rules.registry.changes_to_replay`), so each rule finds its own change replayed when
the time budget allows.

Called once per run, after the first sampled step past step 0 (under gradient accumulation, past the first window:
so optimizer state exists and the counts are those of a steady step), under the time budget the user set. Gradient
accumulation and manual optimization are replayed as Lightning runs them (see
:class:`~lightning_vram.prediction.predictor.Predictor`'s ``accumulate`` and
:mod:`~lightning_vram.prediction.replay.manual`). A set-up the replay does not reproduce is skipped with the
reason, and the rules keep their modelled estimates. Under DDP each rank replays its own step on its own (no
collective runs in a replay), holding DDP's gradient buckets, and is predicted under ZeRO-2 and FSDP full shard too;
under DeepSpeed ZeRO-1/2 each rank replays the unsharded step on its own and predicts its own share by ZeRO's
arithmetic (:func:`try_rank_changes`).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from lightning_vram.advice.catalogue import SHARDING_STRATEGIES
from lightning_vram.advice.rules.offload_optimizer import wants_offload_trial
from lightning_vram.advice.rules.registry import changes_to_replay
from lightning_vram.measure.compiled import compiled_module_names
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.devices import COMMON_GPUS, DEFAULT_CUDA_CONTEXT_BYTES
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.simulation import BUDGET_RAN_OUT, simulate
from lightning_vram.prediction.replay.step import StepFunction
from lightning_vram.prediction.strategies.from_ddp import ddp_trial
from lightning_vram.prediction.strategies.fsdp2 import LiveUnits
from lightning_vram.prediction.strategies.offloading import offload_trial
from lightning_vram.prediction.strategies.rank_replays import RANK_TOLERANCE, RankReplays
from lightning_vram.prediction.strategies.stronger import sharding_trial
from lightning_vram.records import (
    BatchSizeChange,
    DeviceInfo,
    OffloadTrial,
    ReplayedStep,
    RunSummary,
    ShardingTrial,
    Simulation,
    TrainingSetup,
)

PER_RANK_STRATEGIES = frozenset({"DDPStrategy"})
"""Multi-process strategies whose ranks each replay their own step (``ddp``, ``ddp_spawn``: each rank holds the whole
model), with what the strategy itself holds added by its arithmetic (:mod:`~lightning_vram.measure.ddp`)."""


def unsupported(
    module: nn.Module, setup: TrainingSetup, step_function: StepFunction | None, per_rank: bool = False
) -> str | None:
    """Why the replay cannot reproduce this set-up's step, or ``None`` when it can.

    ``per_rank``: the run's sharded strategy is predicted rank by rank
    (:class:`~lightning_vram.prediction.strategies.rank_replays.RankReplays`), so neither sharding nor the world
    size refuses it.
    """
    compiled = compiled_module_names(module)
    if compiled:
        return (
            f"torch.compile ({', '.join(compiled)}): replaying compiled graphs under fake tensors would make them"
            " recompile"
        )
    if step_function is None:
        return "the model has no training_step: pass step_function to VramSession.start to replay its step"
    if per_rank:
        return None
    if setup.strategy in SHARDING_STRATEGIES:
        return f"{setup.strategy}: sharded steps need the other ranks' collectives"
    if setup.world_size > 1 and setup.strategy not in PER_RANK_STRATEGIES:
        return "distributed training: the replay runs one process"
    return None


def try_changes(predictor: Predictor, summary: RunSummary, setup: TrainingSetup, rank: int | None = None) -> Simulation:
    """Replay the sampled step and each change the rules declared; on CUDA also the largest batch per GPU.

    On a rank of a DDP run of several (``predictor.strategy`` holds its buckets; ``rank``: this one) whose baseline
    matched, with time left, the rank is also predicted under ZeRO-2 and FSDP full shard at the same world size
    (:func:`~lightning_vram.prediction.strategies.from_ddp.ddp_trial`, for the ``sharding-stage`` advice).

    ``predictor`` holds the run's step, calibrated by the sampled step's counts, with the replay budget; the caller
    has checked that the set-up is not :func:`unsupported`. What it cannot run it skips with the reason. Raises only
    when a replay left something behind it could not take back
    (:class:`~lightning_vram.prediction.containment.containment.ContainmentError`,
    :class:`~lightning_vram.prediction.containment.escapes.ReplayEscapeError`): the caller turns replays off.
    """
    with round_of_replays():
        simulation = predictor.simulate(changes_to_replay(summary, setup))
        baseline = simulation.baseline
        if simulation.skipped is None and baseline is not None and not predictor.out_of_time():
            trial = ddp_trial(predictor, baseline, setup.world_size, rank)
            if isinstance(trial, ShardingTrial):
                simulation = replace(simulation, sharding=trial)
        if simulation.skipped is not None or not summary.on_cuda:
            return simulation
        if predictor.out_of_time():
            return replace(simulation, fit_note=f"{BUDGET_RAN_OUT} before the fit table's search started")
        search = predictor.fit_table(
            summary.cuda_context_bytes or DEFAULT_CUDA_CONTEXT_BYTES,
            gpus=(*_own_device(summary.device), *COMMON_GPUS),
            known_steps=_replayed_batch_sizes(simulation),
        )
        own = search.rows[0] if summary.device.total_bytes else None
        common = search.rows[1:] if summary.device.total_bytes else search.rows
        return replace(
            simulation,
            fit=tuple(row for row in common if row is not None),
            fit_note="; ".join(note for note in (search.missing, *search.notes) if note is not None) or None,
            device_max_batch_size=own.max_batch_size if own is not None else None,
            seconds=predictor.clock() - predictor.started,
        )


def try_rank_changes(replays: RankReplays, summary: RunSummary, setup: TrainingSetup) -> Simulation:
    """One rank of a sharded run: its sampled step against the per-rank model's, then each declared change.

    Where the baseline matched and time is left, the rank is also predicted under the next stronger ZeRO stage
    (:attr:`~lightning_vram.records.Simulation.sharding`, for the ``sharding-stage`` advice), and, on CUDA near the
    device's capacity where the run does not offload, with CPU offload
    (:attr:`~lightning_vram.records.Simulation.offload`, for the ``offload-optimizer`` advice).

    The baseline is checked with :data:`~lightning_vram.prediction.strategies.rank_replays.RANK_TOLERANCE`; no fit
    table is searched (the model keeps no allocation sequence for the allocator to serve). Raises what
    :func:`try_changes` raises.
    """
    with round_of_replays():
        simulation = simulate(replays, changes_to_replay(summary, setup), RANK_TOLERANCE)
        if simulation.skipped is None and not replays.out_of_time():
            trial = sharding_trial(replays.predictor, replays.spec, replays.settings, replays.rank)
            if isinstance(trial, ShardingTrial):
                simulation = replace(simulation, sharding=trial)
        if simulation.skipped is None and wants_offload_trial(summary) and not replays.out_of_time():
            units = replays.units if isinstance(replays.units, LiveUnits) else None
            offload = offload_trial(replays.predictor, replays.spec, replays.settings, replays.rank, units)
            if isinstance(offload, OffloadTrial):
                simulation = replace(simulation, offload=offload)
    if simulation.skipped is None and summary.on_cuda:
        return replace(simulation, fit_note=f"{replays.spec.label}: no fit table is searched for a sharded rank yet")
    return simulation


def _replayed_batch_sizes(simulation: Simulation) -> dict[int, ReplayedStep]:
    """The steps the simulation replayed by batch size: its baseline and each batch-size change."""
    steps = [(simulation.baseline.batch_size, simulation.baseline)] if simulation.baseline is not None else []
    steps += [
        (variant.change.batch_size, variant.replayed)
        for variant in simulation.variants
        if isinstance(variant.change, BatchSizeChange) and variant.replayed is not None
    ]
    return {size: step for size, step in steps if size is not None}


def _own_device(device: DeviceInfo) -> tuple[tuple[str, int], ...]:
    return ((device.name, device.total_bytes),) if device.total_bytes else ()
