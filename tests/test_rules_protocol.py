"""The rule protocol: the registry's ids, the replay of every change a rule declares, and its saving read back."""

from __future__ import annotations

from dataclasses import replace

from advice_summaries import GIB, MIB, blocks, healthy_setup, healthy_summary, leaky_relu, peak
from simulations import BASELINE, replayed, simulated

from lightning_vram.advice.rules.base import no_reason
from lightning_vram.advice.rules.registry import RULES, advise, changes_to_replay
from lightning_vram.advice.savings import change_key
from lightning_vram.records import (
    BatchSizeChange,
    Breakdown,
    CheckpointChange,
    FreeGradientsChange,
    InplaceChange,
    Phase,
    PrecisionChange,
    RunSummary,
    TrainingSetup,
)


def test_every_rule_has_its_own_stable_id() -> None:
    ids = [rule.id for rule in RULES]
    assert len(ids) == len(set(ids))
    assert set(ids) == {
        "activation-checkpointing",
        "mixed-precision",
        "inplace-activations",
        "chunked-loss",
        "dataloader-workers",
        "pin-memory",
        "stale-gradients",
        "optimizer-state",
        "large-linear",
        "allocator-fragmentation",
        "batch-size-headroom",
        "near-capacity",
        "long-tail",
        "sharding-stage",
        "offload-optimizer",
    }


def declaring_run() -> tuple[RunSummary, TrainingSetup]:
    """A 32-bit run near capacity, with checkpointable blocks, a mergeable activation and gradients in forward."""
    full = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=8 * GIB, other=3 * GIB)
    leaky = leaky_relu()
    summary = healthy_summary(
        peak=peak(Phase.BACKWARD, 15 * GIB, full, reserved=15 * GIB + 256 * MIB),
        modules=(*blocks(4, 750 * MIB, 64 * MIB), leaky),
    )
    return summary, healthy_setup(precision="32-true", inplace_keeps_result=(leaky.name,))


def test_the_replay_tries_every_change_each_rule_declares_once_in_the_rules_order() -> None:
    summary, setup = declaring_run()
    union = changes_to_replay(summary, setup)
    declared = [change for rule in RULES for change in rule.changes(summary, setup)]
    assert {change_key(change) for change in union} == {change_key(change) for change in declared}
    assert len(union) == len({change_key(change) for change in union})
    kinds = [type(change) for change in union]
    assert kinds[0] is PrecisionChange and union[0] == PrecisionChange("bf16-mixed")
    assert CheckpointChange in kinds and InplaceChange in kinds and FreeGradientsChange in kinds
    assert union[-1] == BatchSizeChange(16)  # near capacity: the halved batch, last
    # Not near capacity, in mixed precision: neither the halved batch nor a precision is replayed.
    healthy = changes_to_replay(healthy_summary(), healthy_setup())
    assert not any(isinstance(change, BatchSizeChange | PrecisionChange) for change in healthy)


def test_a_rule_reads_back_the_replay_of_the_change_it_declared() -> None:
    summary, setup = declaring_run()
    halved = next(change for change in changes_to_replay(summary, setup) if isinstance(change, BatchSizeChange))
    simulation = simulated(replayed(halved, 6 * GIB), baseline=BASELINE)
    near = next(advice for advice in advise(summary, setup, simulation) if advice.id == "near-capacity")
    assert "halve the batch to 16 (with accumulate_grad_batches=2): about 2.00 GiB (simulated)" in near.detail
    # A run that accumulates 4 micro-batches keeps its global batch with twice as many halves.
    accumulating = replace(setup, accumulate_grad_batches=4)
    near = next(advice for advice in advise(summary, accumulating, simulation) if advice.id == "near-capacity")
    assert "halve the batch to 16 (with accumulate_grad_batches=8): about 2.00 GiB (simulated)" in near.detail
    assert " Half the batch with accumulate_grad_batches=8 sums the gradients of two halves" in near.detail


def test_every_rule_that_declares_changes_says_why_it_did_not_advise_them() -> None:
    summary, setup = declaring_run()
    declaring = [rule for rule in RULES if rule.changes(summary, setup)]
    assert {rule.id for rule in declaring} >= {"mixed-precision", "activation-checkpointing", "inplace-activations"}
    assert all(rule.why_not is not no_reason for rule in declaring)
    # The design card's data-loading remedies are answered too, with the measured data-wait share.
    answering = {rule.id for rule in RULES if rule.why_not is not no_reason}
    assert {"dataloader-workers", "pin-memory", "long-tail", "stale-gradients", "near-capacity"} <= answering
