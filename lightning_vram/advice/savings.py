"""What a change saves, and how that is known: replayed, else discarded, else modelled.

A rule declares the changes it wants replayed (:attr:`~lightning_vram.advice.rules.base.Rule.changes`) and reads
each one's saving back through :func:`resolve_saving`, the one place that decides where a saving comes from:

- replayed: the simulation's baseline was trusted (replayed and matched) and it replayed the change; the saving is
  the replayed one, the difference of live peaks as the report measures them (every tensor alive: on CUDA in
  512-byte allocator blocks, the allocator's peak; on the CPU in bytes, the sampled step's live peak;
  :meth:`~lightning_vram.records.ReplayedStep.reported_bytes`), quoted against the report's measured peak;
- discarded: the change's replay raised, so it would break the user's step: it is never advised;
- modelled: not replayed (no trusted simulation, or the time budget ran out before the change); the rule's own
  model of the saving from the measurements, where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.records import (
    CheckpointChange,
    PhasePeak,
    ReplayedStep,
    SavingBasis,
    Simulation,
    StepChange,
    VariantResult,
)
from lightning_vram.records.simulation import NOT_REPLAYED
from lightning_vram.units import format_bytes

SHOWN_REASON_CHARACTERS = 160
"""How much of a discarded replay's reason the evidence quotes (an exception's text can be long)."""


def trusted(simulation: Simulation | None) -> ReplayedStep | None:
    """The simulation's baseline when it can be trusted (replayed and matched), else ``None``."""
    if simulation is None or simulation.skipped is not None:
        return None
    return simulation.baseline


def change_key(change: StepChange) -> object:
    """What identifies a change: a checkpointing plan by the modules it checkpoints, not by its modelled saving.

    The plan the session replayed and the plan the rules pick come from the module profiles of different sampled
    steps; their modelled savings may differ where the modules are the same.
    """
    if isinstance(change, CheckpointChange):
        plan = change.plan
        return ("checkpoint", plan.container, plan.units, plan.sequential_segments, plan.forward_of or "", plan.switch)
    return change


def _variant(simulation: Simulation, change: StepChange) -> VariantResult | None:
    """The variant that replayed ``change``, or ``None`` when it was not requested."""
    key = change_key(change)
    return next((variant for variant in simulation.variants if change_key(variant.change) == key), None)


def replayed_step(simulation: Simulation | None, change: StepChange) -> ReplayedStep | None:
    """The step replayed with ``change``, where a trusted simulation replayed it (else ``None``)."""
    if simulation is None or trusted(simulation) is None:
        return None
    variant = _variant(simulation, change)
    return variant.replayed if variant is not None else None


@dataclass(frozen=True)
class Saving:
    """What a change takes off the peak and how that is known.

    ``saving_bytes``: the saving (negative when a replayed peak rises); ``peak_bytes``: the peak it is taken off, the
    replayed baseline's or the measured one; ``predicted_peak_bytes``: the replayed peak with the change made
    (``None`` when modelled); ``evidence``: how the saving is known, in words.
    """

    saving_bytes: int
    peak_bytes: int
    predicted_peak_bytes: int | None
    basis: SavingBasis
    evidence: str

    def at_least(self, share: float) -> bool:
        """Whether the saving is at least ``share`` of the peak it is taken off."""
        return self.saving_bytes >= share * self.peak_bytes


@dataclass(frozen=True)
class Discarded:
    """A change whose replay raised (it would break the user's step): ``reason`` says how."""

    change: StepChange
    reason: str

    @property
    def evidence(self) -> str:
        """That the change is not advised, with its replay's reason (shortened)."""
        reason = self.reason
        if len(reason) > SHOWN_REASON_CHARACTERS:
            reason = reason[: SHOWN_REASON_CHARACTERS - 1] + "…"
        return f"; not advised, its replay raised: {self.change.label} ({reason})"


@dataclass(frozen=True)
class Modelled:
    """A rule's model of a change's saving from the measurements: ``saving_bytes`` off the measured ``peak_bytes``."""

    saving_bytes: int
    peak_bytes: int
    evidence: str


def resolve_saving(
    simulation: Simulation | None, change: StepChange, modelled: Modelled | None, measured: PhasePeak | None = None
) -> Saving | Discarded | None:
    """The saving of ``change``: replayed, else discarded, else ``modelled`` (``None`` without a model).

    Args:
        simulation: the replay of the run's step and of the changes tried on it, or ``None``.
        change: the change, as the rule declared it for replay.
        modelled: the rule's own estimate, used only when the change was not replayed.
        measured: the report's peak; a replayed saving is quoted, and its share judged, against it (else against
            the replayed baseline's peak).
    """
    baseline = trusted(simulation)
    variant = _variant(simulation, change) if simulation is not None and baseline is not None else None
    if baseline is not None and variant is not None and variant.replayed is not None:
        return _replayed_saving(change, baseline, variant.replayed, measured)
    if variant is not None:
        reason = variant.discarded or "the replay gave no result"
        if not reason.startswith(NOT_REPLAYED):
            return Discarded(change, reason)
    if modelled is None:
        return None
    return Saving(modelled.saving_bytes, modelled.peak_bytes, None, SavingBasis.MODELLED, modelled.evidence)


def peak_label(device_type: str) -> str:
    """What a peak is on ``device_type``: the allocator's on CUDA, the live bytes of every tensor elsewhere."""
    return "allocator peak" if device_type == "cuda" else "live peak"


def _replayed_saving(
    change: StepChange, baseline: ReplayedStep, predicted: ReplayedStep, measured: PhasePeak | None
) -> Saving:
    """A replayed change's saving (the replayed live peaks' difference), quoted against the report's peak."""
    before, after = baseline.reported_peak, predicted.reported_peak
    baseline_bytes, predicted_bytes = baseline.reported_bytes(before), predicted.reported_bytes(after)
    saving = baseline_bytes - predicted_bytes
    measure = peak_label(baseline.device_type)
    span = (
        f"{format_bytes(baseline_bytes)} in {before.phase.value} to {format_bytes(predicted_bytes)}"
        f" in {after.phase.value}"
    )
    if measured is None or measured.peak_bytes <= 0:
        evidence = f"replayed on this run's step, {change.label} takes the {measure} from {span}"
        return Saving(saving, baseline_bytes, predicted_bytes, SavingBasis.SIMULATED, evidence)
    verb = "lowers" if saving >= 0 else "raises"
    evidence = (
        f"{change.label} {verb} the {measure} by {format_bytes(abs(saving))}, from the measured"
        f" {format_bytes(measured.peak_bytes)} in {measured.phase.value} to about"
        f" {format_bytes(measured.peak_bytes - saving)} in {after.phase.value}"
        f" (replayed on this run's step from {span})"
    )
    return Saving(saving, measured.peak_bytes, predicted_bytes, SavingBasis.SIMULATED, evidence)
