"""Optimizer state: the largest part of the peak; smaller or sharded alternatives, each with its modelled saving."""

from __future__ import annotations

from lightning_vram.advice.catalogue import SHARDING_STRATEGIES
from lightning_vram.advice.rules.base import Rule, attributed_peak, no_changes, share_text
from lightning_vram.records import (
    Advice,
    AdviceId,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.units import format_bytes

ID = AdviceId.OPTIMIZER_STATE
ADAM_FAMILY = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "FusedAdam"})
"""Optimizers that keep two buffers per parameter (exp_avg and exp_avg_sq)."""
EIGHT_BIT_ADAM_STATE_SHARE = 0.25
"""8-bit Adam keeps 2 bytes of state per parameter instead of 8."""
CONVERGENCE_NOTE = (
    "SGD changes convergence: this model looks like a transformer or language model ({why}), which is trained"
    " with Adam-family optimizers and under SGD needs a new learning rate and schedule and may train worse."
    " What keeps Adam's update and still saves memory: {keeps}."
    " (Fused or foreach AdamW keeps the same state: it is faster, not smaller.)"
)
"""The one line for a language model offered SGD: what it costs, and the alternatives that keep Adam's update."""


def _eight_bit(optimizers: tuple[str, ...]) -> str:
    """The 8-bit optimizer with the run's own update: AdamW's decoupled weight decay is not Adam's L2 penalty.

    >>> _eight_bit(("AdamW",)), _eight_bit(("Adam",))
    ('8-bit AdamW (bitsandbytes.optim.AdamW8bit)', '8-bit Adam (bitsandbytes.optim.Adam8bit)')
    """
    if "AdamW" in optimizers and not ADAM_FAMILY.difference({"AdamW"}).intersection(optimizers):
        return "8-bit AdamW (bitsandbytes.optim.AdamW8bit)"
    return "8-bit Adam (bitsandbytes.optim.Adam8bit)"


def _keeps_adam(setup: TrainingSetup, shardable: bool) -> str:
    """The memory-saving alternatives to SGD that keep Adam's update rule, for this set-up."""
    keeps = ["8-bit Adam (Adam's update, its two moments stored in 8 bits)"]
    if shardable:
        keeps.append("sharding the state across devices (FSDP, DeepSpeed ZeRO: exact)")
    return " or ".join(keeps)


def _sharding_words(summary: RunSummary) -> str:
    """The sharded strategies that take the run's accelerator, in words.

    Off CUDA, Lightning's and Fabric's ``fsdp`` and ``deepspeed`` strategies refuse the accelerator; FSDP2
    (``fully_shard`` under ``ModelParallelStrategy``) runs there (tests/sharded_train.py trains it on gloo ranks).
    """
    if summary.on_cuda:
        return "FSDP or DeepSpeed ZeRO"
    return (
        "FSDP2: fully_shard in configure_model under Lightning's ModelParallelStrategy; its fsdp and deepspeed"
        f" strategies refuse the {summary.device.type}"
    )


def _sharding_code(devices: int, loop: TrainingLoop) -> str:
    """The code that shards the optimizer state over ``devices`` GPUs where ``loop`` trains the model.

    >>> _sharding_code(4, TrainingLoop.FABRIC)
    'Fabric(strategy="fsdp", devices=4)  # each device holds 1/4 of the optimizer state'
    """
    held = f"each device holds 1/{devices} of the optimizer state"
    if loop is TrainingLoop.PLAIN:
        return (
            "from torch.distributed.fsdp import fully_shard\n\n"
            f"fully_shard(model)  # before creating the optimizer, on each of {devices} ranks"
            f" (torchrun --nproc-per-node={devices}): {held}"
        )
    owner = "Fabric" if loop is TrainingLoop.FABRIC else "Trainer"
    return f'{owner}(strategy="fsdp", devices={devices})  # {held}'


def optimizer_state(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Optimizer state is the largest part of the peak: name smaller or sharded alternatives with their savings."""
    attributed = attributed_peak(summary)
    if attributed is None or attributed[1].largest_part != "optimizer_state":
        return None
    peak, breakdown = attributed
    state = breakdown.optimizer_state
    options: list[tuple[int, str]] = []
    adam = any(name in ADAM_FAMILY for name in setup.optimizers)
    if adam:
        options.append((int(state * (1 - EIGHT_BIT_ADAM_STATE_SHARE)), _eight_bit(setup.optimizers)))
        options.append((state // 2, "SGD with momentum (one buffer per parameter instead of two)"))
    sharded = setup.strategy in SHARDING_STRATEGIES  # then the state counted is already this rank's shard
    devices = max(setup.world_size, setup.visible_devices)  # one process on one device has nothing to shard across
    shardable = not sharded and devices > 1
    if shardable:
        options.append((state - state // devices, f"shard it across {devices} devices ({_sharding_words(summary)})"))
    if not options:
        return None
    options.sort(reverse=True)
    listed = "; ".join(f"{text}: saves {format_bytes(saving)}" for saving, text in options)
    convergence = (
        " " + CONVERGENCE_NOTE.format(why=setup.language_model, keeps=_keeps_adam(setup, shardable))
        if adam and setup.language_model is not None
        else ""
    )
    remedy = "shrink or shard it" if shardable else "shrink it"
    example = f"\n```python\n{_sharding_code(devices, setup.loop)}\n```" if shardable and summary.on_cuda else ""
    changes_training = " Sharding keeps the update exact: the same model." if shardable else ""
    if adam:
        changes_training += (
            " 8-bit Adam rounds the moments and SGD is another update: either trains another model, so validate it."
        )
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=f"Optimizer state is the largest part of the peak ({format_bytes(state)}): {remedy}",
        detail=f"Options, largest saving first: {listed}.{changes_training}{convergence}{example}",
        evidence=(
            f"optimizer state ({', '.join(setup.optimizers)}) is {format_bytes(state)},"
            f" {share_text(state, peak.peak_bytes)} of the {peak.phase.value} peak; parameters"
            f" {format_bytes(breakdown.parameters)}, activations {format_bytes(breakdown.activations)}"
            + ("; one process on one device: nothing to shard across" if not sharded and not shardable else "")
            + (f"; it looks like a language model: {setup.language_model}" if setup.language_model is not None else "")
        ),
        estimated_saving_bytes=options[0][0],
        saving_basis=SavingBasis.MODELLED,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why the optimizer state gets no advice: not the peak's largest part, or nothing smaller or sharded to offer.

    ``None`` where the peak was not attributed.
    """
    attributed = attributed_peak(summary)
    if attributed is None:
        return None
    peak, breakdown = attributed
    state = f"optimizer state ({format_bytes(breakdown.optimizer_state)})"
    largest = breakdown.largest_part
    if largest != "optimizer_state":
        return (
            f"{state} is not the largest part of the {peak.phase.value} peak ({largest.replace('_', ' ')} is,"
            f" {format_bytes(getattr(breakdown, largest))})"
        )
    shard = (
        "the state counted is this rank's shard already"
        if setup.strategy in SHARDING_STRATEGIES
        else "one process on one device has nothing to shard across"
    )
    return (
        f"{state} is the largest part of the {peak.phase.value} peak, but {', '.join(setup.optimizers) or 'the'}"
        f" optimizer keeps no Adam-family state to shrink and {shard}"
    )


RULE = Rule(ID, optimizer_state, no_changes, why_not)
