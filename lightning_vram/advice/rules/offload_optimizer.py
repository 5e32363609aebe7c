"""Offload optimizer: a sharded rank near the device's capacity, predicted with its optimizer state on the CPU.

Fires on a CUDA run only (on the CPU the host is the device: offloading moves nothing off it) under DeepSpeed
ZeRO-1/2/3 or FSDP2 that does not offload, whose rank's sampled step the per-rank model reproduced (its baseline
matched, 5% per part), whose measured peak is at or above :data:`~lightning_vram.advice.rules.base.NEAR_CAPACITY_SHARE`
of the device (as ``near-capacity`` and ``mixed-precision`` judge capacity), where no stronger sharding stage is
advised (``sharding-stage``: sharding more costs communication, offload costs host copies and a step on the CPU), and
offload lowers the peak by :data:`~lightning_vram.advice.rules.base.MIN_SAVING_SHARE` of it or more. The rank is
predicted with offload from the same replay
(:func:`~lightning_vram.prediction.strategies.offloading.offload_trial`): ZeRO-Offload moves the fp32 master
partition, the optimizer's state and the gradient partition to the host; FSDP2's ``CPUOffloadPolicy`` the sharded
parameters, their gradients and the state. The advice gives the peak from X (measured) to Y (predicted), the host RAM
the offloaded tensors need on each rank, the bytes copied between host and device per optimizer step with their
time over PCIe at its nominal bandwidth (a lower bound: the optimizer step then runs on the host's CPU, which is not
predicted), and the change for the loop. Offloading moves where the state lives and where the update runs, not the
update's arithmetic (the host's CPU may round differently from the GPU: not bit-identical, unlike sharding more).
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, NEAR_CAPACITY_SHARE, Rule, no_changes, share_text
from lightning_vram.advice.rules.sharding_stage import PERSIST_COMMENT, sharding_stage, stage_of, strategy_words
from lightning_vram.prediction.strategies.deepspeed import LIGHTNING_DEFAULTS
from lightning_vram.prediction.timing.links import LINKS, communication_seconds
from lightning_vram.records import (
    Advice,
    AdviceId,
    OffloadTrial,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.units import format_bytes

ID = AdviceId.OFFLOAD_OPTIMIZER
LINK = LINKS["PCIe 4.0 x16"]
"""The host-device link the copies are priced on: PCIe 4.0 x16 (A100-class hosts; PCIe 5.0 takes half the time)."""
LIGHTNING_OFFLOAD_NAMES = frozenset({2})
"""The ZeRO stages whose Lightning ``_offload`` strategy name is the change predicted (``"deepspeed_stage_2_offload"``):
``"deepspeed_stage_3_offload"`` offloads the parameters too (``offload_parameters=True``), not predicted."""


def wants_offload_trial(summary: RunSummary) -> bool:
    """Whether a rank of this run is worth predicting with offload: on CUDA, its measured peak near capacity."""
    capacity = summary.device.total_bytes
    peak = summary.peak
    return summary.on_cuda and capacity is not None and peak is not None and near(peak.peak_bytes, capacity)


def near(peak_bytes: int, capacity_bytes: int) -> bool:
    """Whether a peak is near the device's capacity (:data:`NEAR_CAPACITY_SHARE` of it or more).

    >>> near(90, 100), near(89, 100)
    (True, False)
    """
    return peak_bytes >= NEAR_CAPACITY_SHARE * capacity_bytes


def trial_of(simulation: Simulation | None) -> OffloadTrial | None:
    """The run's rank predicted with offload, where the replay's baseline was trusted."""
    if simulation is None or simulation.skipped is not None:
        return None
    return simulation.offload


def strategy_code(trial: OffloadTrial, loop: TrainingLoop) -> str:
    """The change to make, as code for ``loop``: the run's strategy with CPU offload, its other settings kept.

    Lightning's ``"deepspeed_stage_3_offload"`` offloads the parameters too (``offload_parameters=True``), which the
    prediction does not: a ZeRO-3 run gets ``DeepSpeedStrategy(stage=3, offload_optimizer=True)``. A ZeRO-3 run with
    parameters DeepSpeed's default ``stage3_param_persistence_threshold`` would keep whole was predicted (and, being
    predicted live, ran) at threshold 0: the code sets it in the strategy's ``config``, as ``sharding-stage``'s does
    (``DeepSpeedStrategy`` takes no argument for it).
    """
    if trial.strategy == "fsdp2":
        where = {
            TrainingLoop.LIGHTNING: "in configure_model",
            TrainingLoop.FABRIC: "in the function that shards the model (parallelize_fn)",
            TrainingLoop.PLAIN: "where you shard the model",
        }[loop]
        return (
            "from torch.distributed.fsdp import CPUOffloadPolicy\n"
            f"fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy())  # {where}: on every unit you shard,"
            " your other arguments kept"
        )
    stage = stage_of(trial.strategy)
    if loop is TrainingLoop.PLAIN:
        return (
            'config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}  # the rest of'
            " your zero_optimization kept, then deepspeed.initialize(..., config=config)"
        )
    owner = "Fabric" if loop is TrainingLoop.FABRIC else "Trainer"
    buckets = (trial.reduce_bucket_size, trial.allgather_bucket_size)
    defaults = buckets == (LIGHTNING_DEFAULTS.reduce_bucket_size, LIGHTNING_DEFAULTS.allgather_bucket_size)
    persist = stage == 3 and trial.small_parameter_bytes > 0
    if defaults and stage in LIGHTNING_OFFLOAD_NAMES:
        return f'{owner}(strategy="{trial.strategy}_offload")'
    arguments = [f"stage={stage}", "offload_optimizer=True"]
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


def moved_words(trial: OffloadTrial) -> str:
    """What goes to the host under the trial's strategy."""
    if trial.strategy == "fsdp2":
        return "FSDP2's CPUOffloadPolicy keeps the sharded parameters, their gradients and the optimizer state"
    return "ZeRO-Offload keeps the fp32 master partition, the optimizer state and the gradient partition"


def copies_text(trial: OffloadTrial) -> str:
    """The bytes copied between host and device per optimizer step, and their time over :data:`LINK`."""
    seconds = communication_seconds(trial.transfer_bytes, LINK)
    return (
        f"It copies {format_bytes(trial.transfer_bytes)} between host and device per optimizer step: at least"
        f" {1e3 * seconds:.1f} ms a step over {LINK.name} ({LINK.bandwidth / 1e9:.1f} GB/s one way, nominal; half"
        " that over PCIe 5.0), and the optimizer step runs on the host's CPU (its time is not predicted)."
    )


def _caveat(trial: OffloadTrial) -> str:
    """What the change needs beside the line of code."""
    if trial.strategy == "fsdp2":
        return (
            " Predicted with unpinned host memory (pin_memory=False; the sizes are the same pinned, pinned copies"
            " overlap better)."
        )
    return (
        " DeepSpeed runs the update with its own CPU Adam under offload: build deepspeed.ops.adam.DeepSpeedCPUAdam"
        " in place of torch's Adam (a torch optimizer needs zero_force_ds_cpu_optimizer set to false)."
    )


def offload_optimizer(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Offload lowers a near-capacity rank's predicted peak by the threshold or more: the change and its cost."""
    trial = trial_of(simulation)
    if trial is None or _held_back(summary, setup, simulation, trial) is not None:
        return None
    saving = trial.saving_bytes
    current = strategy_words(trial.strategy) if trial.strategy != "fsdp2" else "FSDP2"
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=(
            f"Offloading the optimizer state to the CPU takes this rank's peak from {format_bytes(trial.start_bytes)}"
            f" to {format_bytes(trial.target_peak_bytes)}; host RAM needed {format_bytes(trial.host_bytes)}"
        ),
        detail=(
            f"{moved_words(trial)} in host memory: at the same {trial.world_size} ranks this rank's peak falls by"
            f" {format_bytes(saving)}, and each rank needs {format_bytes(trial.host_bytes)} of host RAM for it."
            f" {copies_text(trial)}{_caveat(trial)} The update's arithmetic is the same; run by the host's CPU, its"
            " results can differ from the GPU's in the last bits.\n```python\n"
            f"{strategy_code(trial, setup.loop)}\n```"
        ),
        evidence=(
            f"this rank under {current} x{trial.world_size} {_measured(trial)}, {_capacity(summary, trial)}; with CPU"
            f" offload the per-rank model predicts {format_bytes(trial.target_peak_bytes)} in"
            f" {trial.target_phase.value} ({share_text(saving, trial.start_bytes)} less) on this run's replayed step"
            f" ({trial.method})"
        ),
        estimated_saving_bytes=saving,
        saving_basis=SavingBasis.SIMULATED,
        predicted_peak_bytes=trial.target_peak_bytes,
    )


def _measured(trial: OffloadTrial) -> str:
    """The rank's peak now in words: measured, with the model's figure beside it."""
    if trial.measured_peak_bytes is None:
        return (
            f"peaks at {format_bytes(trial.current_peak_bytes)} by the per-rank model (no measured peak of that"
            " micro-batch)"
        )
    return (
        f"measured a peak of {format_bytes(trial.measured_peak_bytes)} on the sampled step (the model:"
        f" {format_bytes(trial.current_peak_bytes)})"
    )


def _capacity(summary: RunSummary, trial: OffloadTrial) -> str:
    """The peak's share of the device."""
    capacity = summary.device.total_bytes or 0
    return f"{share_text(trial.start_bytes, capacity)} of the device's {format_bytes(capacity)}"


def _held_back(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None, trial: OffloadTrial
) -> str | None:
    """Why a predicted offload is not advised (one line), or ``None`` where it is."""
    capacity = summary.device.total_bytes
    if not summary.on_cuda or capacity is None:
        return "the host is the device off CUDA: offloading moves nothing off it"
    if not near(trial.start_bytes, capacity):
        return (
            f"predicted, offload takes this rank's peak to {format_bytes(trial.target_peak_bytes)}, but its peak"
            f" ({share_text(trial.start_bytes, capacity)} of the device) is under the"
            f" {share_text(int(NEAR_CAPACITY_SHARE * 1000), 1000)} the rule needs"
        )
    if sharding_stage(summary, setup, simulation) is not None:
        return "a stronger sharding stage is advised first (sharding-stage): it adds communication, not host copies"
    if trial.saving_bytes < MIN_SAVING_SHARE * trial.start_bytes:
        return (
            f"predicted, offload takes this rank's peak to {format_bytes(trial.target_peak_bytes)} against"
            f" {format_bytes(trial.start_bytes)}: under the {share_text(int(MIN_SAVING_SHARE * 1000), 1000)} saving"
            " the rule needs"
        )
    return None


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None) -> str | None:
    """Why an offload that was predicted is not advised."""
    trial = trial_of(simulation)
    return None if trial is None else _held_back(summary, setup, simulation, trial)


RULE = Rule(ID, offload_optimizer, no_changes, why_not)
