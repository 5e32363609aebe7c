"""Optimizer state: the largest part of the peak; smaller or sharded alternatives, each with its modelled saving."""

from __future__ import annotations

from lightning_vram.advice.catalogue import SHARDING_STRATEGIES
from lightning_vram.advice.rules.base import Rule, attributed_peak, no_changes, share_text
from lightning_vram.records import Advice, AdviceId, RunSummary, SavingBasis, Severity, Simulation, TrainingSetup
from lightning_vram.units import format_bytes

ID = AdviceId.OPTIMIZER_STATE
ADAM_FAMILY = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "FusedAdam"})
"""Optimizers that keep two buffers per parameter (exp_avg and exp_avg_sq)."""
EIGHT_BIT_ADAM_STATE_SHARE = 0.25
"""8-bit Adam keeps 2 bytes of state per parameter instead of 8."""


def optimizer_state(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Optimizer state is the largest part of the peak: name smaller or sharded alternatives with their savings."""
    attributed = attributed_peak(summary)
    if attributed is None or attributed[1].largest_part != "optimizer_state":
        return None
    peak, breakdown = attributed
    state = breakdown.optimizer_state
    options: list[tuple[int, str]] = []
    if any(name in ADAM_FAMILY for name in setup.optimizers):
        options.append((int(state * (1 - EIGHT_BIT_ADAM_STATE_SHARE)), "8-bit Adam (bitsandbytes.optim.Adam8bit)"))
        options.append((state // 2, "SGD with momentum (one buffer per parameter instead of two)"))
    sharded = setup.strategy in SHARDING_STRATEGIES  # then the state counted is already this rank's shard
    if not sharded and setup.world_size > 1:
        options.append((state - state // setup.world_size, f"shard it across {setup.world_size} devices (FSDP)"))
    elif not sharded:
        options.append((state // 2, "shard it with FSDP or DeepSpeed ZeRO: 1/N of it on each of N devices"))
    if not options:
        return None
    options.sort(reverse=True)
    listed = "; ".join(f"{text}: saves {format_bytes(saving)}" for saving, text in options)
    remedy = "shrink it" if sharded else "shrink or shard it"
    example = (
        ""
        if sharded
        else '\n```python\nTrainer(strategy="fsdp")  # with several GPUs: each holds 1/N of the optimizer state\n```'
    )
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=f"Optimizer state is the largest part of the peak ({format_bytes(state)}): {remedy}",
        detail=f"Options, largest saving first: {listed}.{example}",
        evidence=(
            f"optimizer state ({', '.join(setup.optimizers)}) is {format_bytes(state)},"
            f" {share_text(state, peak.peak_bytes)} of the {peak.phase.value} peak; parameters"
            f" {format_bytes(breakdown.parameters)}, activations {format_bytes(breakdown.activations)}"
        ),
        estimated_saving_bytes=options[0][0],
        saving_basis=SavingBasis.MODELLED,
    )


RULE = Rule(ID, optimizer_state, no_changes)
