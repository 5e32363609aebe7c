"""Every rule, in order, what they want replayed together, the advice they give a run, and why they gave no more.

:data:`RULES` is the registry: a new rule is a module with a :class:`~lightning_vram.advice.rules.base.Rule` and
one line here. Its order is the order the rules' changes are replayed in (the first ones first when the time
budget runs short) and, between advice of the same severity and saving, the order the advice is listed in.
"""

from __future__ import annotations

from lightning_vram.advice.rules import (
    activation_checkpointing,
    allocator_fragmentation,
    batch_size_headroom,
    chunked_loss,
    dataloader_workers,
    inplace_activations,
    large_linear,
    long_tail,
    mixed_precision,
    near_capacity,
    offload_optimizer,
    optimizer_state,
    pin_memory,
    sharding_stage,
    stale_gradients,
)
from lightning_vram.advice.rules.base import Rule
from lightning_vram.advice.savings import change_key
from lightning_vram.advice.time_cost import with_replayed_change, with_time_cost
from lightning_vram.records import Advice, NotAdvised, RunSummary, Severity, Simulation, StepChange, TrainingSetup

RULES: tuple[Rule, ...] = (
    mixed_precision.RULE,
    activation_checkpointing.RULE,
    inplace_activations.RULE,
    chunked_loss.RULE,
    dataloader_workers.RULE,
    pin_memory.RULE,
    stale_gradients.RULE,
    optimizer_state.RULE,
    sharding_stage.RULE,
    offload_optimizer.RULE,
    large_linear.RULE,
    allocator_fragmentation.RULE,
    long_tail.RULE,
    batch_size_headroom.RULE,
    near_capacity.RULE,
)

SEVERITY_ORDER = {severity: rank for rank, severity in enumerate(Severity)}
"""Advice is listed most severe first."""


def changes_to_replay(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """The union of the changes every rule declares for this run, each once, in the rules' order."""
    seen: set[object] = set()
    union: list[StepChange] = []
    for rule in RULES:
        for change in rule.changes(summary, setup):
            key = change_key(change)
            if key not in seen:
                seen.add(key)
                union.append(change)
    return tuple(union)


def advise(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> tuple[Advice, ...]:
    """Every rule's advice for this run, most severe first, then by estimated saving (bytes), largest first.

    ``simulation`` is the replay of the run's sampled step and of the changes tried on it: where it replayed a
    change and its baseline matched, the rule's saving is the replayed one (``saving_basis`` ``"simulated"``), and
    its step-time cost the FLOPs its replay counted beside the baseline's
    (:func:`~lightning_vram.advice.time_cost.with_time_cost`).
    """
    found = [
        with_replayed_change(with_time_cost(advice, summary, simulation), summary, simulation)
        for rule in RULES
        if (advice := rule.advise(summary, setup, simulation)) is not None
    ]
    return tuple(
        sorted(found, key=lambda advice: (SEVERITY_ORDER[advice.severity], -(advice.estimated_saving_bytes or 0)))
    )


def not_advised(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None, advice: tuple[Advice, ...]
) -> tuple[NotAdvised, ...]:
    """Why each rule that gave none of ``advice`` did not advise what it weighed, in the rules' order.

    A rule answers a change it had replayed with the replay's figure, one it could not replay with why (not weighed
    by replay, or its modelled figure), a measured share with its threshold; only a rule whose readings were not
    measured at all (no attributed peak, no profiled module, not this device's) is left out.
    """
    advised = {item.id for item in advice}
    return tuple(
        NotAdvised(rule.id, reason)
        for rule in RULES
        if rule.id not in advised and (reason := rule.why_not(summary, setup, simulation)) is not None
    )
