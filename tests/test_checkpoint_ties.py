"""Checkpointing plans whose replays save the same bytes: the one that recomputes the fewest modules is advised."""

from __future__ import annotations

import pytest
from advice_summaries import blocks, healthy_setup, healthy_summary

from lightning_vram.advice.checkpointing import checkpoint_candidates, recomputed_modules
from lightning_vram.advice.rules import activation_checkpointing as rule
from lightning_vram.advice.savings import Saving
from lightning_vram.records import CheckpointChange, SavingBasis, StepChange

MIB = 1024**2


def test_of_plans_replayed_to_the_same_saving_the_one_recomputing_least_is_advised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    summary = healthy_summary(modules=blocks(4, 200 * MIB, 10 * MIB))
    plans = checkpoint_candidates(summary.modules)
    # Modelled, the three-layer plan comes first; the two-layer plan recomputes a module less.
    assert [(recomputed_modules(plan), plan.saving_bytes) for plan in plans] == [
        (3, 597_688_320),
        (4, 587_202_560),
        (2, 398_458_880),
    ]

    def replayed(simulation: object, change: StepChange, model: object, measured: object) -> Saving:
        # Every plan's replay lowers the peak by the same 1 GiB (the recomputed units' bytes are not at the peak).
        return Saving(1024 * MIB, 8192 * MIB, 7168 * MIB, SavingBasis.SIMULATED, "; replayed")

    monkeypatch.setattr(rule, "resolve_saving", replayed)
    advice = rule.activation_checkpointing(summary, healthy_setup())
    assert advice is not None and advice.estimated_saving_bytes == 1024 * MIB
    assert "`encoder.layers.1`" in advice.title and "encoder.layers.0" not in advice.title, advice.title
    # Why it is not advised names the same plan: the figure of the one recomputing two modules.
    monkeypatch.setattr(rule, "replayed_figure", lambda simulation, change: f"{rule._recomputed(change)} modules")
    why = rule.why_not(summary, healthy_setup())
    assert why is not None and why.startswith("2 modules: "), why
    assert rule._recomputed(CheckpointChange(plans[0])) == 3
