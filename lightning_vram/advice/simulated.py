"""What the step replay says about one change: its peak before and after, measured as the report measures peaks.

On CUDA the report's peaks are the allocator's, so a replay's peak is its predicted allocator peak (every live tensor,
in 512-byte blocks); on the CPU the report's peaks are the sums of the counted parts, so a replay's peak is the
highest sum of its counted parts (:meth:`~lightning_vram.records.ReplayedStep.reported_bytes`). A simulation is read
only when its baseline was trusted (``skipped`` is ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.advice.replay.simulation import NOT_REPLAYED
from lightning_vram.records import (
    CheckpointChange,
    ReplayedStep,
    Simulation,
    StepChange,
    VariantResult,
)


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
        return ("checkpoint", plan.container, plan.units, plan.sequential_segments, plan.forward_of or "")
    return change


def find_variant(simulation: Simulation, change: StepChange) -> VariantResult | None:
    """The variant that replayed ``change``, or ``None`` when it was not requested."""
    key = change_key(change)
    return next((variant for variant in simulation.variants if change_key(variant.change) == key), None)


@dataclass(frozen=True)
class Replayed:
    """A change replayed on the run's step: the baseline and the step with the change made.

    Peaks are read as the report measures them (:meth:`~lightning_vram.records.ReplayedStep.reported_bytes`).
    """

    change: StepChange
    baseline: ReplayedStep
    predicted: ReplayedStep

    @property
    def device_type(self) -> str:
        """The replayed device's type."""
        return self.baseline.device_type

    @property
    def baseline_bytes(self) -> int:
        """The replayed baseline's peak, in bytes."""
        return self.baseline.reported_bytes(self.baseline.reported_peak)

    @property
    def predicted_bytes(self) -> int:
        """The peak predicted with the change made, in bytes."""
        return self.predicted.reported_bytes(self.predicted.reported_peak)

    @property
    def saving_bytes(self) -> int:
        """What the change takes off the peak, in bytes (negative when the peak rises)."""
        return self.baseline_bytes - self.predicted_bytes


@dataclass(frozen=True)
class Discarded:
    """A change whose replay raised (it would break the user's step): ``reason`` says how."""

    change: StepChange
    reason: str


def trial(simulation: Simulation | None, change: StepChange) -> Replayed | Discarded | None:
    """What the replay found for ``change``: its peak, that it broke the step, or ``None`` when it was not tried.

    Not tried: no trusted simulation, the change was not requested, or the time budget ran out before it.
    """
    baseline = trusted(simulation)
    if simulation is None or baseline is None:
        return None
    variant = find_variant(simulation, change)
    if variant is None:
        return None
    if variant.replayed is not None:
        return Replayed(change, baseline, variant.replayed)
    reason = variant.discarded or "the replay gave no result"
    return None if reason.startswith(NOT_REPLAYED) else Discarded(change, reason)
