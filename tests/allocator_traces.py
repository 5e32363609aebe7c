"""The recorded GPU traces in tests/data/gpu-traces, cut into steps and phases at their markers, and replayed.

More traces in the same format (``NAME.pickle`` as ``torch.cuda.memory._dump_snapshot()`` wrote it, ``NAME.json``
with the run's ``markers`` and ``truth``: see tests/data/gpu-traces/README.md) join every trace test when their
folders are named in ``LIGHTNING_VRAM_GPU_TRACES`` (separated by ``os.pathsep``): traces recorded elsewhere are
checked without copying them into the project.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings

TRACES = Path(__file__).parent / "data" / "gpu-traces"
SHIPPED = ("gpt2-b8", "gpt2-b150", "gpt2-b150-expandable", "llama-b4", "resnet50-b64")
"""The traces this project keeps: the model replays each to its recorded reserved peak, to the byte."""
MORE_TRACES_VARIABLE = "LIGHTNING_VRAM_GPU_TRACES"


def _discovered() -> dict[str, Path]:
    """Every trace (a snapshot with its measurements beside it) by name: the project's, then each named folder's."""
    found = {name: TRACES / f"{name}.pickle" for name in SHIPPED}
    for folder in filter(None, os.environ.get(MORE_TRACES_VARIABLE, "").split(os.pathsep)):
        for snapshot in sorted(Path(folder).glob("*.pickle")):
            if snapshot.with_suffix(".json").is_file():
                found[f"{Path(folder).name}/{snapshot.stem}"] = snapshot
    return found


SNAPSHOTS = _discovered()
NAMES = tuple(SNAPSHOTS)
PHASES = (("batch_start", "forward"), ("before_backward", "backward"), ("before_optimizer_step", "optimizer"))
"""The marker that opens each phase, and the phase."""


@dataclass(frozen=True)
class PhasePeaks:
    """One phase of one step: the allocator's recorded peaks (the run's ``truth``) and the model's, in bytes."""

    step: int
    phase: str
    recorded_allocated: int
    recorded_reserved: int
    simulated_allocated: int
    simulated_reserved: int


def load(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trace's snapshot and the figures its run measured beside it."""
    with SNAPSHOTS[name].open("rb") as file:
        snapshot = pickle.load(file)
    return snapshot, json.loads(SNAPSHOTS[name].with_suffix(".json").read_text())


def run_settings(name: str) -> AllocatorSettings:
    """The allocator settings the trace's run had, from its measurements (``alloc_conf``)."""
    return AllocatorSettings.from_conf(load(name)[1].get("alloc_conf") or "")


def replay_phases(name: str, settings: AllocatorSettings | None = None) -> list[PhasePeaks]:
    """Replay one trace through the model, the peaks reset where each phase's marker is allocated (just before it:
    that is where the run read and reset the allocator's peaks)."""
    snapshot, measured = load(name)
    if settings is None:
        settings = run_settings(name)
    model = CachingAllocatorModel(settings)
    markers = {marker["bytes"]: (marker["step"], marker["at"]) for marker in measured["markers"]}
    live: dict[int, int] = {}
    reached: dict[tuple[int, str], tuple[int, int]] = {}
    phase: tuple[int, str] | None = None
    for block, event in enumerate(snapshot["device_traces"][0]):
        action = event["action"]
        if action == "alloc":
            if event["size"] in markers:
                if phase is not None:
                    reached[phase] = (model.peak_allocated_bytes, model.peak_reserved_bytes)
                model.reset_peaks()
                phase = markers[event["size"]]
            live[event["addr"]] = block
            model.malloc(block, event["size"], event["stream"])
        elif action == "free_completed":
            model.free(live.pop(event["addr"]))
    peaks = []
    for truth in measured["truth"]:
        for marker, name_of_phase in PHASES:
            allocated, simulated = reached[(truth["step"], marker)]
            recorded = truth[name_of_phase]
            peaks.append(
                PhasePeaks(
                    step=truth["step"],
                    phase=name_of_phase,
                    recorded_allocated=recorded["allocated_peak"],
                    recorded_reserved=recorded["reserved_peak"],
                    simulated_allocated=allocated,
                    simulated_reserved=simulated,
                )
            )
    return peaks
