"""Sharding stage: the next stronger sharding at the same world size, this rank's peak predicted under both.

Fires on a live DeepSpeed ZeRO-1/2 run whose rank was predicted under the next stage by the per-rank model
(:attr:`~lightning_vram.records.Simulation.sharding`): ZeRO-1 to ZeRO-2 partitions the gradients, ZeRO-2 to ZeRO-3
the parameters too; and on a live DDP run whose rank was predicted under ZeRO-2 and FSDP full shard (the lower of
the two, under Lightning's defaults for each: DDP's gradient buckets go, the state is partitioned). The advice gives
this rank's peak from X (measured on the sampled step, else predicted) to Y (predicted), the saving, what the
stronger sharding sends per optimizer step beyond the run's, with ZeRO-Offload the host memory its offloaded state
needs, and the exact change for the loop that trains the model, keeping the run's bucket settings (which the
prediction used). Sharding more changes where each element lives and what is communicated, not the update: the same
Adam step over the same averaged gradients (ZeRO-2 to ZeRO-3 bit-identical on 2 CPU ranks in fp32,
tests/test_sharded_advice.py).

A DDP run off CUDA (gloo ranks on the CPU) gets no such change: Lightning's and Fabric's FSDP and DeepSpeed strategies
refuse any accelerator but CUDA (``Trainer(strategy="fsdp")`` raises "The strategy `fsdp` requires a GPU accelerator"
in Lightning 2.6, ``"deepspeed_stage_2"`` "The DeepSpeed strategy is only supported on CUDA GPUs"), and the plain loop's
change is written for a CUDA device; ``not_advised`` says so, with the predicted figures.
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, Rule, no_changes, share_text
from lightning_vram.prediction.strategies.deepspeed import LIGHTNING_DEFAULTS
from lightning_vram.records import (
    Advice,
    AdviceId,
    RunSummary,
    SavingBasis,
    Severity,
    ShardingTrial,
    Simulation,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.records.simulation import PERSISTENCE_THRESHOLD
from lightning_vram.units import format_bytes

ID = AdviceId.SHARDING_STAGE
MIN_SHARDING_SAVING_SHARE = MIN_SAVING_SHARE
"""The saving (a share of the rank's predicted peak) below which a stronger stage is not worth its communication."""


def trial_of(simulation: Simulation | None) -> ShardingTrial | None:
    """The run's rank predicted under the next stronger stage, where the replay's baseline was trusted."""
    if simulation is None or simulation.skipped is not None:
        return None
    return simulation.sharding


def stage_of(name: str) -> int:
    """The ZeRO stage a strategy name carries.

    >>> stage_of("deepspeed_stage_3")
    3
    """
    return int(name.removeprefix("deepspeed_stage_"))


def strategy_words(name: str) -> str:
    """How the advice names a strategy of :class:`~lightning_vram.records.StrategySpec`'s names.

    >>> strategy_words("fsdp"), strategy_words("deepspeed_stage_2")
    ('FSDP (full shard)', 'ZeRO-2')
    """
    if name.startswith("deepspeed_stage_"):
        return f"ZeRO-{stage_of(name)}"
    return {"ddp": "DDP", "fsdp": "FSDP (full shard)"}[name]


def sharded_words(trial: ShardingTrial) -> str:
    """What the target shards beyond the run's strategy."""
    if trial.current == "ddp":
        return (
            "parameters, gradients and optimizer state" if trial.target == "fsdp" else "gradients and optimizer state"
        )
    return "gradients" if stage_of(trial.target) == 2 else "parameters"


def from_ddp_code(trial: ShardingTrial, loop: TrainingLoop) -> str:
    """The change from DDP to the trial's target as code for ``loop``, with the settings the prediction used.

    Lightning's and Fabric's strategy names mean them (``"fsdp"``: FULL_SHARD, no wrap policy; ``"deepspeed_stage_2"``:
    2e8-element buckets, ``overlap_comm``, contiguous gradients); a plain loop wraps the model in their place.
    """
    if loop is not TrainingLoop.PLAIN:
        owner = "Fabric" if loop is TrainingLoop.FABRIC else "Trainer"
        return f'{owner}(strategy="{trial.target}")'
    if trial.target == "fsdp":
        return (
            "model = torch.distributed.fsdp.FullyShardedDataParallel(model, device_id=torch.cuda.current_device())"
            "  # in place of DistributedDataParallel(model); build the optimizer after it, on model.parameters()"
        )
    zero = (
        f'{{"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size":'
        f' {trial.reduce_bucket_size:_}, "allgather_bucket_size": {trial.allgather_bucket_size:_}}}'
    )
    return (
        f'model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={{"zero_optimization":'
        f" {zero}, ...}})  # in place of DistributedDataParallel(model)"
    )


def strategy_code(trial: ShardingTrial, loop: TrainingLoop) -> str:
    """The change to make, as code for ``loop``: the target stage with the run's settings the prediction used.

    A ZeRO-3 target partitions every parameter as predicted (``stage3_param_persistence_threshold`` 0) where the model
    has parameters DeepSpeed's default would keep whole. Lightning's and Fabric's ``DeepSpeedStrategy`` take no
    argument for it (``DeepSpeedStrategy(param_persistence_threshold=0)`` raises ``TypeError``): the code sets it in
    the strategy's ``config`` (the ``zero_optimization`` section it wrote) before the strategy is used. An offloading
    run's ZeRO-3 target is ``DeepSpeedStrategy(stage=3, offload_optimizer=True)``: Lightning's
    ``"deepspeed_stage_3_offload"`` offloads the parameters too, which the prediction does not.
    """
    if trial.current == "ddp":
        return from_ddp_code(trial, loop)
    stage = stage_of(trial.target)
    persist = stage == 3 and trial.small_parameter_bytes > 0
    buckets = (trial.reduce_bucket_size, trial.allgather_bucket_size)
    defaults = buckets == (LIGHTNING_DEFAULTS.reduce_bucket_size, LIGHTNING_DEFAULTS.allgather_bucket_size)
    if loop is TrainingLoop.PLAIN:
        settings = [f'"stage": {stage}']
        if persist:
            settings.append('"stage3_param_persistence_threshold": 0')
        return (
            f'config["zero_optimization"].update({{{", ".join(settings)}}})  # the rest of your zero_optimization'
            " kept, then deepspeed.initialize(..., config=config)"
        )
    owner = "Fabric" if loop is TrainingLoop.FABRIC else "Trainer"
    # Lightning's "deepspeed_stage_3_offload" offloads the parameters too (offload_parameters=True): not predicted
    if defaults and not persist and not (trial.offload and stage == 3):
        return f'{owner}(strategy="{trial.target}{"_offload" if trial.offload else ""}")'
    arguments = [f"stage={stage}"]
    if trial.offload:
        arguments.append("offload_optimizer=True")
    if not defaults:
        arguments += [
            f"reduce_bucket_size={trial.reduce_bucket_size:_}",
            f"allgather_bucket_size={trial.allgather_bucket_size:_}",
        ]
    strategy = f"DeepSpeedStrategy({', '.join(arguments)})"
    if persist:
        return (
            f"strategy = {strategy}\n"
            f'strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # {PERSIST_COMMENT}\n'
            f"{owner}(strategy=strategy)"
        )
    return f"{owner}(strategy={strategy})"


PERSIST_COMMENT = "partition every parameter, as predicted"
"""The comment beside the line of :func:`strategy_code` that sets ``stage3_param_persistence_threshold``."""


def needs_cuda(trial: ShardingTrial, summary: RunSummary) -> bool:
    """Whether the trial's change cannot be applied on the run's accelerator: from DDP to FSDP or ZeRO, off CUDA.

    Lightning's and Fabric's ``fsdp`` and ``deepspeed*`` strategies refuse any accelerator but CUDA; the plain loop's
    change wraps the model for the current CUDA device.
    """
    return trial.current == "ddp" and not summary.on_cuda


def sharding_stage(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """A stronger ZeRO stage lowers this rank's predicted peak by the threshold or more: the change and its cost.

    Silent where the change cannot be applied on the run's accelerator (:func:`needs_cuda`).
    """
    trial = trial_of(simulation)
    if trial is None:
        return None
    saving = trial.saving_bytes
    if saving < MIN_SHARDING_SAVING_SHARE * trial.start_bytes or needs_cuda(trial, summary):
        return None
    current, target = strategy_words(trial.current), strategy_words(trial.target)
    extra = trial.extra_communication_bytes
    sent = (
        f"sends {format_bytes(extra)} more per optimizer step ({format_bytes(trial.target_communication_bytes)}"
        f" against {format_bytes(trial.current_communication_bytes)})"
        if extra > 0
        else f"sends {format_bytes(trial.target_communication_bytes)} per optimizer step, no more than now"
    )
    host = (
        f" ZeRO-Offload stays on: the offloaded optimizer state, fp32 master and gradient partition need"
        f" {format_bytes(trial.target_host_bytes)} of host RAM per rank under {target}."
        if trial.offload
        else ""
    )
    persist = (
        f" `stage3_param_persistence_threshold` 0 partitions every parameter, as predicted: DeepSpeed's default"
        f" ({PERSISTENCE_THRESHOLD:,} elements) would keep the parameters under it"
        f" ({format_bytes(trial.small_parameter_bytes)} here) whole on every rank, for fewer all-gathers."
        if trial.target == "deepspeed_stage_3" and trial.small_parameter_bytes > 0
        else ""
    )
    code = strategy_code(trial, setup.loop)
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=(
            f"{current} to {target} takes this rank's peak from {format_bytes(trial.start_bytes)}"
            f" to {format_bytes(trial.target_peak_bytes)}"
        ),
        detail=(
            f"Shard the {sharded_words(trial)}{'' if trial.current == 'ddp' else ' too'}: at the same"
            f" {trial.world_size} ranks, {target} saves {format_bytes(saving)} of this rank's peak and"
            f" {sent}.{host}{persist} {_same_update(trial)}\n```python\n{code}\n```"
        ),
        evidence=(
            f"this rank under {current} x{trial.world_size} {_now(trial)}; under {target} the per-rank model"
            f" predicts {format_bytes(trial.target_peak_bytes)} in {trial.target_phase.value}"
            f" ({share_text(saving, trial.start_bytes)} less) on this run's replayed step ({trial.method})"
        ),
        estimated_saving_bytes=saving,
        saving_basis=SavingBasis.SIMULATED,
        predicted_peak_bytes=trial.target_peak_bytes,
    )


def _same_update(trial: ShardingTrial) -> str:
    """What the change does to the update, in words."""
    if trial.current != "ddp":
        return "The update is the same (the same optimizer step over the same averaged gradients): the same model."
    same = (
        "The update is the same optimizer step over the same averaged gradients (summed in another order: equal to"
        " float rounding in fp32)."
    )
    if trial.target == "fsdp":
        return f"{same} Predicted with the root as the only unit; a wrap policy (auto_wrap_policy) holds less."
    return f"{same} Under a 16-bit precision DeepSpeed trains 16-bit weights beside an fp32 master copy."


def _now(trial: ShardingTrial) -> str:
    """The rank's peak under the run's strategy in words: measured, with the model's figure beside it."""
    predicted = f"{format_bytes(trial.current_peak_bytes)} in {trial.current_phase.value}"
    if trial.measured_peak_bytes is None:
        return (
            f"peaks at {predicted} by the per-rank model (no measured peak of that micro-batch: the sampled step's"
            " was not measured, or was another micro-batch of an accumulation window)"
        )
    return f"measured a peak of {format_bytes(trial.measured_peak_bytes)} on the sampled step (the model: {predicted})"


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None) -> str | None:
    """Why a stronger sharding that was predicted is not advised: its saving is under the threshold, or it is refused.

    Refused: the change cannot be applied on the run's accelerator (:func:`needs_cuda`).
    """
    trial = trial_of(simulation)
    if trial is None:
        return None
    sharding = "" if trial.target_sharding is None else f" {trial.target_sharding}"
    predicted = (
        f"predicted, {trial.target} x{trial.world_size}{sharding} peaks at {format_bytes(trial.target_peak_bytes)}"
        f" on this rank against {format_bytes(trial.start_bytes)} under {trial.current}"
    )
    if trial.saving_bytes < MIN_SHARDING_SAVING_SHARE * trial.start_bytes:
        return f"{predicted}: under the {share_text(int(MIN_SHARDING_SAVING_SHARE * 1000), 1000)} saving the rule needs"
    if needs_cuda(trial, summary):
        return (
            f"{predicted}, but this run trains on {summary.device.type}: Lightning's and Fabric's {trial.target}"
            " strategy requires a CUDA accelerator and refuses this one (the plain loop's change is written for CUDA)"
        )
    return None


RULE = Rule(ID, sharding_stage, no_changes, why_not)
