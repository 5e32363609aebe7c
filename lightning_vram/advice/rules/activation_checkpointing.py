"""Activation checkpointing: activations hold the largest part of the peak, and checkpointing frees a tenth of it.

The best :data:`~lightning_vram.advice.checkpointing.CANDIDATE_PLANS` plans by modelled saving are candidates,
with the best one's trim (the plan without the units it can lose for nearly nothing,
:func:`~lightning_vram.advice.checkpointing.trimmed`) and the best one without its last unit (which the model can
misjudge), each declared for replay. The modelled saving ranks plans by
bytes alone: the best ones can recompute units that free nothing at the peak (a ResNet's stem and last block), which
their trim leaves out. Where the simulation replayed any of them, only a replayed plan can be advised: the cheapest
of those that realise nearly the best saving (:func:`advised_choice`). A plan whose replay raised would break
backward and is never advised. Without a replay of any candidate, the best modelled plan is advised with its
modelled saving.

Which replayed plan, exactly:

- the plans whose replayed saving is within
  :data:`~lightning_vram.advice.checkpointing.SAVING_TOLERANCE` (2%) of the measured peak of the largest replayed
  saving (and, where that one meets the rule's :data:`CHECKPOINT_MIN_SAVING_SHARE`, meet it too) realise nearly
  the best saving. Two percent is twice the replay's own tolerance against a measured step (its baseline must match
  each part within 1%) and a fifth of what the rule asks of a plan: a plan recomputing a third less is worth more
  than the last sliver of the saving;
- of them, those whose recomputation is predicted to take least time, priced as the memory-budget search
  (``predict(memory_budget=...)``) prices it (:func:`~lightning_vram.advice.time_cost.recompute_costs`: the
  recomputed ops on the run's device, with the CPU's checkpointing overhead an op; the recomputed FLOPs where the
  device's peaks are not known). The host's peaks are measured in the run, so its load moves these times: plans that
  recompute the same work (the same recomputed FLOPs and bytes moved) or are predicted within
  :data:`~lightning_vram.advice.cost_ties.COST_TOLERANCE` (5%) of the least all recompute least
  (:meth:`~lightning_vram.advice.time_cost.RecomputeCosts.least`), and the time does not choose between them;
- of those, the least recomputed work as counted (FLOPs, then bytes moved:
  :func:`~lightning_vram.advice.cost_ties.counted_work`), then the larger saving, then the plan that recomputes the
  fewest modules, then the fewest units (segments), then the first in the simulation's order (the candidates by
  modelled saving, then the best one's trims): nothing the run's timing changes. The step time quoted is the advised
  plan's (:func:`~lightning_vram.advice.time_cost.cheapest_alike` breaks a tie of replayed peaks the same way).

The evidence's recomputation figure is the ranking's: the recomputed ops alone, priced on the device's peaks, not
calibrated by the run's step time. The advice's time cost is another figure, the whole step predicted with the
change and scaled by the run's measured step time, less that step time (:mod:`~lightning_vram.advice.time_cost`);
the evidence says which is which.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.advice.checkpoint_code import CodeContext, checkpoint_snippet
from lightning_vram.advice.checkpointing import (
    ROOT,
    SAVING_TOLERANCE,
    Held,
    ProfileIndex,
    checkpoint_candidates,
    checkpointed_peak_saving,
    recomputed_modules,
)
from lightning_vram.advice.cost_ties import COST_TOLERANCE, Work, counted_work
from lightning_vram.advice.rules.base import Rule, attributed_peak, not_replayed, replayed_figure, share_text
from lightning_vram.advice.savings import (
    Discarded,
    Modelled,
    Saving,
    change_key,
    replayed_step,
    resolve_saving,
    trusted,
)
from lightning_vram.advice.time_cost import RecomputeCosts, recompute_costs
from lightning_vram.records import (
    Advice,
    AdviceId,
    Breakdown,
    CheckpointChange,
    CheckpointPlan,
    Phase,
    PhasePeak,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    StepChange,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.ACTIVATION_CHECKPOINTING
CHECKPOINT_MIN_SAVING_SHARE = 0.10
"""Checkpointing costs about one extra forward pass per step: advise it only for a tenth of the peak or more."""
MODELLED_CHECKPOINT = (
    "saving modelled storage by storage from the sampled step's saved tensors (not replayed): each checkpointed"
    " unit keeps its input, and backward recomputes one unit at a time, holding every gradient and the gradients"
    " flowing through the unit, with backward's temporaries as at its measured peak (conservative: a bound from"
    " below)"
)
"""How the checkpointing advice's evidence says its saving is known, when no candidate plan was replayed."""


def candidates_of(summary: RunSummary, setup: TrainingSetup) -> list[CheckpointPlan]:
    """The candidate plans of the sampled step's modules.

    None checkpoints again what the step recomputed already (its
    :attr:`~lightning_vram.records.RunSummary.recomputed_units`: an applied plan's wrappers, the user's own).
    """
    return checkpoint_candidates(summary.modules, setup.checkpointing_switches, checkpointed=_checkpointed(summary))


def _checkpointed(summary: RunSummary) -> list[str]:
    """The modules the sampled step recomputed in backward (none where not recorded)."""
    return [name for unit in summary.recomputed_units or () for name in unit]


def modelled_saving_of(summary: RunSummary, plan: CheckpointPlan) -> int:
    """``plan``'s modelled saving of the run's peak: its activations' where the step's phases were not all counted.

    Else what the run's peak falls by, the peak moved where the change moves it
    (:func:`~lightning_vram.advice.checkpointing.peak_saving`): a bound from below, at most the activations' saving.
    """
    held = _held(summary)
    if held is None:
        return plan.saving_bytes
    return checkpointed_peak_saving(summary.modules, plan, held, _checkpointed(summary))


def _held(summary: RunSummary) -> Held | None:
    """What the sampled step held besides its saved activations (``None`` where the peak was not counted).

    Forward's and backward's records (the run's peak for its own phase); a phase not counted, or recorded above the
    run's peak (not this run's), counts as the peak.
    """
    peak = summary.peak
    if peak is None or peak.breakdown is None:
        return None
    counted = {
        phase: (record.peak_bytes, record.breakdown)
        for phase, record in summary.phases.items()
        if record.breakdown is not None and record.peak_bytes <= peak.peak_bytes
    }
    counted[peak.phase] = (peak.peak_bytes, peak.breakdown)
    forward_bytes, ahead = counted.get(Phase.FORWARD, counted[peak.phase])
    backward_bytes, behind = counted.get(Phase.BACKWARD, counted[peak.phase])
    return Held(
        forward=ahead.counted_bytes - ahead.activations,
        forward_other=max(forward_bytes - ahead.counted_bytes, 0),
        backward=behind.parameters + behind.optimizer_state + max(parts.gradients for _, parts in counted.values()),
        backward_other=max(backward_bytes - behind.counted_bytes, 0),
        peak=peak.peak_bytes,
    )


def changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """Each candidate checkpointing plan of the sampled step's modules."""
    return tuple(CheckpointChange(plan) for plan in candidates_of(summary, setup))


def activation_checkpointing(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """Activations hold the largest part of the peak and checkpointing some modules would free a tenth of it."""
    attributed = attributed_peak(summary)
    if attributed is None or attributed[1].largest_part != "activations":
        return None
    peak, breakdown = attributed
    candidates = candidates_of(summary, setup)
    modelled = [
        Modelled(modelled_saving_of(summary, plan), peak.peak_bytes, MODELLED_CHECKPOINT) for plan in candidates
    ]
    found = [
        (plan, resolve_saving(simulation, CheckpointChange(plan), model, measured=peak))
        for plan, model in zip(candidates, modelled, strict=True)
    ]
    savings = [(plan, saving) for plan, saving in found if isinstance(saving, Saving)]
    discarded = [saving for _, saving in found if isinstance(saving, Discarded)]
    choice = advised_choice(summary, setup, simulation)
    cheaper = ""
    if choice is not None:
        plan, best = choice.plan, choice.saving
        cheaper = choice.evidence
    elif discarded or not savings:
        return None
    else:
        plan, best = savings[0]
    if not best.at_least(CHECKPOINT_MIN_SAVING_SHARE):
        return None
    top = sorted(summary.modules, key=lambda profile: -profile.activation_bytes)[:3]
    top_text = ", ".join(f"{profile.name} {format_bytes(profile.activation_bytes)}" for profile in top)
    root = next((profile.type for profile in summary.modules if profile.name == ROOT), None)
    what, code = checkpoint_snippet(plan, CodeContext(setup.loop, root, frozenset(setup.keyed_containers)))
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=f"Checkpoint {what} to free about {format_bytes(best.saving_bytes)}",
        detail=(
            "Activation checkpointing keeps only each unit's input in forward and recomputes the rest during"
            " backward, one unit at a time: about one extra forward pass of the checkpointed units for the memory."
            " No unit starts with an inplace op (backward would find its kept input overwritten).\n"
            f"```python\n{code}\n```"
        ),
        evidence=(
            f"activations are {share_text(breakdown.activations, peak.peak_bytes)} of the {peak.phase.value} peak"
            f" ({format_bytes(breakdown.activations)} of {format_bytes(peak.peak_bytes)}); top modules: {top_text};"
            f" {best.evidence}{cheaper}{''.join(item.evidence for item in discarded)}"
        ),
        estimated_saving_bytes=best.saving_bytes,
        saving_basis=best.basis,
        predicted_peak_bytes=best.predicted_peak_bytes,
    )


@dataclass(frozen=True)
class Choice:
    """The replayed plan advised, and how it was chosen.

    ``saving``: its saving; of the ``alike`` plans (nearly the best saving) it is the one at ``index``, of those
    that recompute least by ``costs`` (``None``: none priced) the one counting the least recomputed work, then saving
    most; ``best`` (at ``best_index``): the largest saving.
    """

    plan: CheckpointPlan
    saving: Saving
    alike: int
    costs: RecomputeCosts | None
    index: int
    best: Saving
    best_index: int

    @property
    def evidence(self) -> str:
        """How it was chosen, in words (``""`` where no other plan saved alike).

        >>> saving = Saving(3, 10, 7, SavingBasis.SIMULATED, "")
        >>> costs = RecomputeCosts((0.05, 0.08), True, ((9, 9), (12, 9)), "this CPU (2 threads)")
        >>> choice = Choice(CheckpointPlan("n", (("n.a",),), None, 3), saving, 2, costs, 0, saving, 1)
        >>> head, cost = choice.evidence.split(": ", 1)
        >>> head
        '; of 2 replayed plans saving within 2.0% of the peak of the most (3 B), it recomputes least'
        >>> import textwrap
        >>> print(textwrap.fill(cost, 110))
        its recomputed ops priced at 50.0 ms, against 80.0 ms for the one saving most (a figure to rank plans by, on
        this CPU (2 threads), not calibrated: the time cost is the whole step's with the change, calibrated by this
        run's measured step time, less that time)
        >>> alike = RecomputeCosts((0.05, 0.05), True, ((9, 9), (9, 9)), "this CPU (2 threads)")
        >>> from dataclasses import replace
        >>> tie = replace(choice, costs=alike).evidence
        >>> "it saves most of the 2 that recompute least (the same recomputed FLOPs and bytes, or predicted" in tie
        True
        >>> near = RecomputeCosts((0.05, 0.051), True, ((9, 9), (9, 12)), "this CPU (2 threads)")
        >>> near_evidence = replace(choice, costs=near).evidence
        >>> "it counts the fewest recomputed FLOPs, then bytes moved, of the 2 that" in near_evidence
        True
        """
        if self.alike < 2:
            return ""
        head = (
            f"; of {self.alike} replayed plans saving within {format_percent(SAVING_TOLERANCE)} of the peak of the"
            f" most ({format_bytes(self.best.saving_bytes)}), it"
        )
        if self.costs is None:
            return f"{head} recomputes the fewest modules"
        against = (
            f", against {self.costs.text(self.best_index)} for the one saving most"
            if self.index != self.best_index
            else ""
        )
        least = self.costs.least()
        how = "recomputes least"
        if len(least) > 1:
            tolerance = format_percent(COST_TOLERANCE)
            within = f", or predicted within {tolerance} of the least" if self.costs.seconds else ""
            alike = f"the {len(least)} that recompute least (the same recomputed FLOPs and bytes{within})"
            works = {self.costs.work[index] for index in least} if self.costs.work else set()
            how = (
                f"saves most of {alike}"
                if len(works) < 2
                else f"counts the fewest recomputed FLOPs, then bytes moved, of {alike}"
            )
        if not self.costs.seconds:
            return f"{head} {how}: {self.costs.text(self.index)} a step{against}"
        where = self.costs.priced_on or "the device's peaks"
        priced = (
            f"a figure to rank plans by, on {where}, not calibrated: the time cost is the whole step's with the"
            " change, calibrated by this run's measured step time, less that time"
        )
        return f"{head} {how}: its recomputed ops priced at {self.costs.text(self.index)}{against} ({priced})"


def advised_choice(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None) -> Choice | None:
    """The replayed candidate the rule advises (see the module's doc).

    ``None`` where none was replayed or the peak is not attributed.
    """
    attributed = attributed_peak(summary)
    if attributed is None:
        return None
    peak = attributed[0]
    candidates = candidates_of(summary, setup)
    variants = simulation.variants if simulation is not None else ()
    order = {change_key(variant.change): index for index, variant in enumerate(variants)}
    replayed = []
    for plan in candidates:
        saving = resolve_saving(simulation, CheckpointChange(plan), None, measured=peak)
        if isinstance(saving, Saving) and saving.basis == SavingBasis.SIMULATED:
            replayed.append((plan, saving))
    if not replayed:
        return None
    # Without a simulation (a test's savings), the candidates' own order.
    replayed.sort(key=lambda pair: order.get(change_key(CheckpointChange(pair[0])), len(order)))
    best = max((saving for _, saving in replayed), key=lambda saving: saving.saving_bytes)  # the first of equals
    floor = best.saving_bytes - SAVING_TOLERANCE * best.peak_bytes
    enough = best.at_least(CHECKPOINT_MIN_SAVING_SHARE)
    alike = [
        (plan, saving)
        for plan, saving in replayed
        if saving.saving_bytes >= floor and (saving.at_least(CHECKPOINT_MIN_SAVING_SHARE) or not enough)
    ]
    steps = [replayed_step(simulation, CheckpointChange(plan)) for plan, _ in alike]
    costs = recompute_costs(steps, trusted(simulation), summary.device)

    least = costs.least() if costs is not None else frozenset(range(len(alike)))

    work = costs.work if costs is not None and costs.work else (None,) * len(alike)

    def key(index: int) -> tuple[bool, Work, int, int, int, int]:
        plan, saving = alike[index]
        return (
            index not in least,
            counted_work(work[index]),
            -saving.saving_bytes,
            recomputed_modules(plan),
            len(plan.units),
            index,
        )

    index = min(range(len(alike)), key=key)
    plan, saving = alike[index]
    best_index = next(index for index, (_, saving) in enumerate(alike) if saving is best)
    return Choice(plan, saving, len(alike), costs, index, best, best_index)


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why checkpointing is not advised: the best replayed plan's figure against the rule's threshold.

    Where activations are the largest part of the peak and no plan is a candidate, why none would lower it
    (:func:`no_plan_reason`).
    """
    attributed = attributed_peak(summary)
    if attributed is None:
        return None
    peak, breakdown = attributed
    found = [(change, resolve_saving(simulation, change, None, measured=peak)) for change in changes(summary, setup)]
    replayed = [(change, saving) for change, saving in found if isinstance(saving, Saving)]
    if (
        not found
        and breakdown.largest_part == "activations"
        and not any(switch.on for switch in setup.checkpointing_switches)
    ):
        return no_plan_reason(summary, peak, breakdown)
    if not replayed:
        raised = next((saving for _, saving in found if isinstance(saving, Discarded)), None)
        if raised is not None:
            return f"every candidate plan's replay raised, e.g. {raised.evidence[2:]}"
        return _unreplayed_reason(summary, setup, simulation, peak, breakdown)
    change, best = max(replayed, key=lambda pair: (pair[1].saving_bytes, -_recomputed(pair[0])))
    if breakdown.largest_part != "activations":
        why = f"activations are not the largest part of the peak ({breakdown.largest_part.replace('_', ' ')} is)"
    else:
        why = (
            f"saves {format_bytes(best.saving_bytes)} ({share_text(best.saving_bytes, best.peak_bytes)} of the"
            f" measured peak), under the {format_percent(CHECKPOINT_MIN_SAVING_SHARE)} the rule needs"
        )
    return f"{replayed_figure(simulation, change)}: {why}"


def _unreplayed_reason(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None, peak: PhasePeak, breakdown: Breakdown
) -> str:
    """Why checkpointing is not advised where no plan was replayed: the peak's largest part, else the modelled plan.

    The rule's modelled saving is that of the first candidate plan, as :func:`activation_checkpointing` reads it.
    """
    if breakdown.largest_part != "activations":
        return f"activations are not the largest part of the peak ({breakdown.largest_part.replace('_', ' ')} is)"
    candidates = candidates_of(summary, setup)
    if not candidates:
        switches = [f"{switch.model or 'the module'}.{switch.method}()" for switch in setup.checkpointing_switches]
        return f"the model checkpoints its layers already ({', '.join(switches)}): no other plan is a candidate"
    saving = modelled_saving_of(summary, candidates[0])
    return (
        f"{not_replayed(simulation, CheckpointChange(candidates[0]))}; modelled, the first candidate plan saves"
        f" {format_bytes(saving)} ({share_text(saving, peak.peak_bytes)} of the peak), under the"
        f" {format_percent(CHECKPOINT_MIN_SAVING_SHARE)} the rule needs"
    )


def no_plan_reason(summary: RunSummary, peak: PhasePeak, breakdown: Breakdown) -> str | None:
    """Why activations, the largest part of the peak, get no checkpointing plan: none would lower the peak.

    A plan checkpoints consecutive child modules of one module, one by one; where no module ran two or more, or
    checkpointing them would free nothing (an ``nn.LSTM`` saves nearly all in its own ops, and a checkpoint of it
    recomputes them all at once in backward), no plan is a candidate. The module that saved the most activations
    in its own ops is named, with what the user could change; where it is checkpointed already (an applied plan's
    wrapper), the step's checkpointing is named instead: another checkpoint would recompute it twice, and
    ``predict(memory_budget=...)`` weighs its whole and selective checkpointing by replay. ``None`` when no module's
    profile was recorded.
    """
    indexed = ProfileIndex(summary.modules, _checkpointed(summary))
    if not indexed.called:
        return None
    measured = (
        f"activations are {share_text(breakdown.activations, peak.peak_bytes)} of the {peak.phase.value} peak"
        f" ({format_bytes(breakdown.activations)} of {format_bytes(peak.peak_bytes)})"
    )
    if any(len(names) >= 2 for names in indexed.children.values()):
        why = "checkpointing consecutive child modules of any module one by one would not lower it"
    else:
        why = "no module ran two or more child modules to checkpoint one by one"
    holder = max(indexed.called.values(), key=lambda profile: profile.activation_bytes, default=None)
    if holder is None or holder.activation_bytes <= 0:
        return f"{measured}, but {why}"
    if indexed.rechecks([holder.name]):
        units = summary.recomputed_units or ()
        selective = len(summary.selective_units or ())
        how = f", {selective} of them selectively" if selective else ""
        return (
            f"{measured}, but the step checkpoints {len(units)} unit(s) already{how}, {holder.name} ({holder.type})"
            f" saving the most ({format_bytes(holder.activation_bytes)} in its own ops): a checkpoint around or inside"
            " one would recompute it twice, and checkpointing the other modules' children one by one would not lower"
            " the peak; predict(..., memory_budget=...) weighs checkpointing units whole against selectively by replay"
        )
    alone = "" if holder.name in indexed.children else ", with no child modules,"
    layers = f" (for a multi-layer nn.{holder.type}, one nn.{holder.type} per layer)" if holder.type in RNNS else ""
    return (
        f"{measured}, but {why}: {holder.name} ({holder.type}) saves {format_bytes(holder.activation_bytes)} in its"
        f" own ops{alone} and a checkpoint of it would recompute them all at once in backward; split its forward"
        f" into child modules called in turn{layers} to checkpoint them one by one"
    )


RNNS = frozenset({"LSTM", "GRU", "RNN"})
"""Recurrent layers whose ``num_layers`` stack runs inside one module: one module per layer can be checkpointed."""


def _recomputed(change: StepChange) -> int:
    """The modules a checkpointing change recomputes (0 for any other change)."""
    return recomputed_modules(change.plan) if isinstance(change, CheckpointChange) else 0


RULE = Rule(ID, activation_checkpointing, changes, why_not)
