"""A run's aggregates in a checkpoint, so that the report after a resume covers the whole run."""

from __future__ import annotations

from typing import Any, NamedTuple

from lightning_vram.config import MonitorConfig
from lightning_vram.exceptions import warn
from lightning_vram.measure.timing import StepTimer
from lightning_vram.measure.tracker import MemoryTracker
from lightning_vram.records import Simulation
from lightning_vram.records.json_reader import FormatError
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict

STATE_VERSION = 2
"""Version of :func:`saved_state`'s layout; a checkpoint with another one starts the aggregates fresh."""


class RunState(NamedTuple):
    """What a checkpoint carries of a run: its phase peaks, step times and replayed advice."""

    tracker: MemoryTracker
    timer: StepTimer
    simulation: Simulation | None


def saved_state(state: RunState) -> dict[str, Any]:
    """``state`` as plain data for a checkpoint."""
    return {
        "version": STATE_VERSION,
        "tracker": state.tracker.state_dict(),
        "timer": state.timer.state_dict(),
        "simulation": simulation_to_dict(state.simulation),  # a resumed run keeps its replayed advice
    }


def restored_state(saved: Any, config: MonitorConfig, owner: str) -> RunState | None:
    """The run :func:`saved_state` wrote, or ``None`` with one warning for anything else.

    Anything else: another version, a field missing or mistyped; the aggregates then start fresh. ``owner``, the
    object the user made, begins the warning.
    """
    version = saved.get("version") if isinstance(saved, dict) else None
    if version != STATE_VERSION:
        _warn_fresh(owner, f"its version is {version!r}, not {STATE_VERSION}")
        return None
    tracker = MemoryTracker(config.recent_steps, config.reset_peak_stats)
    timer = StepTimer(config.recent_steps, config.clock)
    try:
        tracker.load_state_dict(saved.get("tracker"))
        timer.load_state_dict(saved.get("timer"))
        simulation = simulation_from_dict(saved.get("simulation"))
    except FormatError as error:
        _warn_fresh(owner, str(error))
        return None
    return RunState(tracker, timer, simulation)


def _warn_fresh(owner: str, reason: str) -> None:
    warn(
        f"{owner}: the checkpoint's monitor state cannot be used ({reason}); the report covers only the run"
        " since the resume."
    )
