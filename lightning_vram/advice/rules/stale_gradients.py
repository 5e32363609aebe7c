"""Stale gradients: last step's gradients are alive at a forward-phase peak under automatic optimization.

The saving is the replayed one where the simulation set the gradients to ``None`` before forward (a replay that
raised means no advice): the difference of the live peaks, so where another phase (backward, on most language
models) peaks as high, freeing them saves nothing and the rule stays silent. Otherwise modelled: the gradients,
down to the next highest phase's peak.
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, Rule, attributed_peak, replayed_reason
from lightning_vram.advice.savings import Modelled, Saving, peak_label, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    FreeGradientsChange,
    Phase,
    RunSummary,
    Severity,
    Simulation,
    StepChange,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.STALE_GRADIENTS


def changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """Gradients freed before forward, when the sampled forward pass ran with gradients alive."""
    forward = summary.phases.get(Phase.FORWARD)
    if setup.automatic_optimization and forward is not None and forward.breakdown and forward.breakdown.gradients:
        return (FreeGradientsChange(),)
    return ()


def stale_gradients(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Last step's gradients are alive at a forward-phase peak under automatic optimization."""
    attributed = attributed_peak(summary)
    if not setup.automatic_optimization or attributed is None:
        return None
    peak, breakdown = attributed
    if peak.phase is not Phase.FORWARD or breakdown.gradients <= 0:
        return None
    next_highest = max((p.peak_bytes for phase, p in summary.phases.items() if phase is not Phase.FORWARD), default=0)
    modelled = Modelled(
        min(breakdown.gradients, peak.peak_bytes - next_highest),
        peak.peak_bytes,
        "saving modelled: the gradients, down to the next highest phase (not replayed)",
    )
    saving = resolve_saving(simulation, FreeGradientsChange(), modelled, measured=peak)
    if not isinstance(saving, Saving) or not saving.at_least(MIN_SAVING_SHARE):
        return None
    return Advice(
        id=ID,
        severity=Severity.WARNING,
        title="Free the previous step's gradients before the forward pass",
        detail=(
            "Lightning zeroes gradients after training_step, so the last step's gradients stay allocated through"
            " the forward pass, where this run peaks. Free them at batch start, outside an accumulation window (the"
            " batches where Lightning zeroes them anyway: training is unchanged, bit for bit):\n"
            "```python\n"
            "def on_train_batch_start(self, batch, batch_idx):\n"
            "    if batch_idx % self.trainer.accumulate_grad_batches == 0:\n"
            "        for optimizer in self.trainer.optimizers:\n"
            "            optimizer.zero_grad(set_to_none=True)\n"
            "```"
        ),
        evidence=(
            f"the {peak_label('cuda' if summary.on_cuda else 'cpu')} ({format_bytes(peak.peak_bytes)}) is in forward"
            f" of step {peak.step}, with"
            f" {format_bytes(breakdown.gradients)} of gradients alive; the next highest phase peaks at"
            f" {format_bytes(next_highest)}; {saving.evidence}"
        ),
        estimated_saving_bytes=saving.saving_bytes,
        saving_basis=saving.basis,
        predicted_peak_bytes=saving.predicted_peak_bytes,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why freeing the gradients before forward, replayed, is not advised: the peak, or the saving, is elsewhere."""
    peak = summary.peak
    where = "the peak is not in forward" if peak is None or peak.phase is not Phase.FORWARD else None
    why = where or f"under the {format_percent(MIN_SAVING_SHARE)} of the peak the rule needs"
    return replayed_reason(simulation, changes(summary, setup), why)


RULE = Rule(ID, stale_gradients, changes, why_not)
