"""Stale gradients: last step's gradients are alive at a forward-phase peak under automatic optimization.

The saving is the replayed one where the simulation set the gradients to ``None`` before forward (a replay that
raised means no advice): the difference of the live peaks, so where another phase (backward, on most language
models) peaks as high, freeing them saves nothing and the rule stays silent. Otherwise modelled: the gradients,
down to the next highest phase's peak.
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import (
    MIN_SAVING_SHARE,
    Rule,
    attributed_peak,
    not_replayed,
    replayed_figure,
    replayed_reason,
    share_text,
)
from lightning_vram.advice.savings import Modelled, Saving, peak_label, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    FreeGradientsChange,
    Phase,
    PhasePeak,
    RunSummary,
    Severity,
    Simulation,
    StepChange,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.STALE_GRADIENTS


def changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """Gradients freed before forward, when the sampled forward pass ran with gradients alive."""
    forward = summary.phases.get(Phase.FORWARD)
    if setup.lightning_zeroes_gradients and forward is not None and forward.breakdown and forward.breakdown.gradients:
        return (FreeGradientsChange(),)
    return ()


def _next_highest(summary: RunSummary) -> int:
    """The highest measured peak in bytes of a phase other than forward (0: none measured)."""
    return max((p.peak_bytes for phase, p in summary.phases.items() if phase is not Phase.FORWARD), default=0)


def _modelled(peak: PhasePeak, gradients: int, next_highest: int) -> Modelled:
    """Freeing ``gradients`` (bytes) before forward, modelled: down to the ``next_highest`` phase's peak (bytes)."""
    return Modelled(
        min(gradients, peak.peak_bytes - next_highest),
        peak.peak_bytes,
        "saving modelled: the gradients, down to the next highest phase (not replayed)",
    )


LIGHTNING_DETAIL = (
    "Lightning zeroes gradients after training_step, so the last step's gradients stay allocated through"
    " the forward pass, where this run peaks. Free them at batch start, outside an accumulation window (the"
    " batches where Lightning zeroes them anyway: training is unchanged, bit for bit), in a Callback listed"
    " before VramMonitor: Lightning runs the callbacks' on_train_batch_start in list order, then the"
    " LightningModule's, and the monitor starts measuring the step in its own, so gradients freed after it"
    " would still count in forward:\n"
    "```python\n"
    "class FreeGradientsBeforeForward(Callback):\n"
    "    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):\n"
    "        if batch_idx % trainer.accumulate_grad_batches == 0:\n"
    "            for optimizer in trainer.optimizers:\n"
    "                optimizer.zero_grad(set_to_none=True)\n"
    "\n"
    "trainer = Trainer(callbacks=[FreeGradientsBeforeForward(), VramMonitor()])  # before VramMonitor\n"
    "```"
)
"""What to change under a Trainer: a Callback that frees the gradients before the monitor measures the step."""

LOOP_DETAIL = (
    "The loop frees or zeroes the gradients after the forward pass (or zeroes them in place, set_to_none=False),"
    " so the last step's gradients stay allocated through the forward pass, where this run peaks. Set them to"
    " None at batch start instead, before the forward pass, in the batches where the loop zeroes them anyway (the"
    " first of each accumulation window): where the loop set them to None already (zero_grad()'s default),"
    " training is unchanged, bit for bit; where it zeroed them in place, an optimizer then skips a parameter that"
    " got no gradient in a step (weight decay and momentum included), as zero_grad()'s default has it:\n"
    "```python\n"
    "for step, batch in enumerate(loader):\n"
    "    session.batch_start(batch)\n"
    "    if step % accumulate_grad_batches == 0:  # every step without accumulation\n"
    "        optimizer.zero_grad(set_to_none=True)  # here, before the forward pass, and not after it\n"
    "    loss = ...  # the forward pass, backward and optimizer.step() as before\n"
    "```"
)
"""What to change in a plain or Fabric loop: set the gradients to ``None`` before the forward pass."""


def _detail(loop: TrainingLoop) -> str:
    """The advice's explanation and code for what trains the model: a Trainer's Callback, or a line in the loop."""
    return LIGHTNING_DETAIL if loop is TrainingLoop.LIGHTNING else LOOP_DETAIL


def stale_gradients(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Last step's gradients are alive at a forward-phase peak under automatic optimization."""
    attributed = attributed_peak(summary)
    if not setup.lightning_zeroes_gradients or attributed is None:
        return None
    peak, breakdown = attributed
    if peak.phase is not Phase.FORWARD or breakdown.gradients <= 0:
        return None
    next_highest = _next_highest(summary)
    modelled = _modelled(peak, breakdown.gradients, next_highest)
    saving = resolve_saving(simulation, FreeGradientsChange(), modelled, measured=peak)
    if not isinstance(saving, Saving) or not saving.at_least(MIN_SAVING_SHARE):
        return None
    return Advice(
        id=ID,
        severity=Severity.WARNING,
        title="Free the previous step's gradients before the forward pass",
        detail=_detail(setup.loop),
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
    """Why freeing the gradients before forward is not advised: the peak, or the saving, is elsewhere.

    With the replay's figure where the change was replayed, else the modelled saving; under manual optimization the
    user's step owns its gradients, and so does a LightningModule that overrides ``optimizer_zero_grad``. ``None``
    where the peak was not attributed.
    """
    if not setup.automatic_optimization:
        return "under manual optimization the step zeroes its own gradients, where it chooses"
    if setup.own_zero_grad:
        return (
            "the LightningModule overrides optimizer_zero_grad: it zeroes the gradients where it chooses (it may keep"
            " them across batches to accumulate), so freeing them at batch start could discard gradients it still"
            " needs"
        )
    attributed = attributed_peak(summary)
    if attributed is None:
        return None
    peak, breakdown = attributed
    under = f"under the {format_percent(MIN_SAVING_SHARE)} of the peak the rule needs"
    if peak.phase is not Phase.FORWARD or breakdown.gradients <= 0:
        where = (
            f"the peak is in {peak.phase.value}, not forward"
            if peak.phase is not Phase.FORWARD
            else "no gradients are alive at the forward peak"
        )
        figure = replayed_figure(simulation, FreeGradientsChange()) if changes(summary, setup) else None
        return f"{figure}: {where}" if figure is not None else where
    saving = resolve_saving(simulation, FreeGradientsChange(), None, measured=peak)
    if saving is not None:
        return replayed_reason(simulation, changes(summary, setup), under)
    modelled = _modelled(peak, breakdown.gradients, _next_highest(summary))
    return (
        f"{not_replayed(simulation, FreeGradientsChange())}; modelled, freeing the {format_bytes(breakdown.gradients)}"
        f" of gradients alive at the forward peak saves {format_bytes(max(modelled.saving_bytes, 0))}"
        f" ({share_text(max(modelled.saving_bytes, 0), peak.peak_bytes)}): {under}"
    )


RULE = Rule(ID, stale_gradients, changes, why_not)
