"""The monitor's run aggregates as plain Python data, for Lightning checkpoints.

Only dicts, lists, strings, numbers and ``None``: checkpoints then load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import Any

from lightning_vram.records import Attribution, Breakdown, ModuleProfile, Phase, PhasePeak

STATE_VERSION = 1


def breakdown_state(breakdown: Breakdown | None) -> dict[str, int | None] | None:
    """A breakdown as a dict of bytes."""
    return breakdown.to_dict() if breakdown is not None else None


def breakdown_from_state(state: dict[str, Any] | None) -> Breakdown | None:
    """The breakdown :func:`breakdown_state` saved."""
    return Breakdown(**state) if state is not None else None


def phase_peak_state(peak: PhasePeak) -> dict[str, Any]:
    """A phase peak as plain data."""
    return {
        "step": peak.step,
        "phase": peak.phase.value,
        "peak_bytes": peak.peak_bytes,
        "reserved_bytes": peak.reserved_bytes,
        "breakdown": breakdown_state(peak.breakdown),
    }


def phase_peak_from_state(state: dict[str, Any]) -> PhasePeak:
    """The phase peak :func:`phase_peak_state` saved."""
    return PhasePeak(
        step=state["step"],
        phase=Phase(state["phase"]),
        peak_bytes=state["peak_bytes"],
        reserved_bytes=state["reserved_bytes"],
        breakdown=breakdown_from_state(state["breakdown"]),
    )


def attribution_state(attribution: Attribution | None) -> dict[str, Any] | None:
    """A sampled step's counts as plain data."""
    if attribution is None:
        return None
    return {
        "step": attribution.step,
        "phases": {phase.value: breakdown_state(parts) for phase, parts in attribution.phases.items()},
        "modules": [
            [
                profile.name,
                profile.type,
                profile.activation_bytes,
                profile.input_bytes,
                profile.output_bytes,
                profile.inplace,
                profile.input_saved_for_backward,
            ]
            for profile in attribution.modules
        ],
        "batch_size": attribution.batch_size,
    }


def attribution_from_state(state: dict[str, Any] | None) -> Attribution | None:
    """The counts :func:`attribution_state` saved."""
    if state is None:
        return None
    phases = {Phase(name): breakdown_from_state(parts) for name, parts in state["phases"].items()}
    return Attribution(
        step=state["step"],
        phases={phase: parts for phase, parts in phases.items() if parts is not None},
        modules=tuple(ModuleProfile(*row) for row in state["modules"]),
        batch_size=state["batch_size"],
    )
