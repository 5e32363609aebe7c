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
from lightning_vram.prediction.allocator.snapshot import settings_from_snapshot

TRACES = Path(__file__).parent / "data" / "gpu-traces"
AT_CAPACITY = (
    "h100-gpt2-b91",
    "h100-gpt2-b91-expandable",
    "h100-gpt2-b96",
    "h100-gpt2-b96-expandable",
    "h100-resnet50-b947-expandable",
    "h100-resnet50-b952",
    "h100-resnet50-b995-expandable",
    "h100-resnet50-b1000",
    "h100-llama-b86",
)
"""Traces recorded on an H100 at its capacity (their measurements' ``free_at_start_bytes``), five of them out of memory:
replayed at that capacity."""
MONITORED = ("h100-resnet50-b64-monitored",)
"""ResNet-50 at batch 64 recorded on the H100 with the monitor on, after other runs in the same process: its new
segments came in ascending addresses, where the first run in a process had them descend (docs/allocator-model.md).
Replayed at the capacity it had, in every phase within 1% of its recorded reserve (0.72% at worst, backward), where
numbering every segment below the last (the model's order before) came out 3.5% under."""
SHIPPED = ("gpt2-b8", "gpt2-b150", "gpt2-b150-expandable", "llama-b4", "resnet50-b64", *AT_CAPACITY, *MONITORED)
"""The traces this project keeps: the model replays each to its recorded reserved peaks, to the byte (those recorded
at capacity, at that capacity), but for ``MONITORED`` (within 1%: see there)."""
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


def monitored(name: str) -> bool:
    """Whether the trace's run had the monitor on (scripts/gpu_check.py names such traces ``*-monitored``): the
    monitor resets the allocator's peaks when it reads them at each phase boundary, just before the recording reads
    them, so the run's ``truth`` holds each phase's closing figures, not its peaks. Its reserved figures are the peaks
    all the same where the reserve only grows within a phase (as in ``MONITORED``); its allocated ones are not. (Since
    the ninth session of 2026-11-27 the recording reads before the monitor and leaves the resets to it: the traces it
    records so hold each phase's peaks.)"""
    return name.endswith("-monitored")


def load(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trace's snapshot and the figures its run measured beside it."""
    with SNAPSHOTS[name].open("rb") as file:
        snapshot = pickle.load(file)
    return snapshot, json.loads(SNAPSHOTS[name].with_suffix(".json").read_text())


def capacity(name: str) -> int | None:
    """The device memory the trace's run had free when it began (bytes), where its measurements give it."""
    found = load(name)[1].get("free_at_start_bytes")
    return int(found) if found is not None else None


def run_settings(name: str) -> AllocatorSettings:
    """The allocator settings the trace's run had, from its measurements (``alloc_conf``), else from the snapshot's
    ``allocator_settings`` (the H100 traces' measurements name none)."""
    snapshot, measured = load(name)
    recorded = settings_from_snapshot(snapshot.get("allocator_settings"))
    if measured.get("alloc_conf") is None and recorded is not None:
        return recorded
    return AllocatorSettings.from_conf(measured.get("alloc_conf") or "")


def replay_phases(name: str, settings: AllocatorSettings | None = None) -> list[PhasePeaks]:
    """Replay one trace through the model, the peaks reset where each phase's marker is allocated (just before it:
    that is where the run read and reset the allocator's peaks), at the capacity the run had where its measurements
    give one (``free_at_start_bytes``), to the run's end or its last ``oom`` event (an earlier one the run survived:
    cuDNN asked for a workspace that did not fit and took another algorithm, as ResNet-50 at the H100's capacity
    did)."""
    snapshot, measured = load(name)
    if settings is None:
        settings = run_settings(name)
    model = CachingAllocatorModel(settings, capacity_bytes=measured.get("free_at_start_bytes"))
    markers = {marker["bytes"]: (marker["step"], marker["at"]) for marker in measured["markers"]}
    live: dict[int, int] = {}
    reached: dict[tuple[int, str], tuple[int, int]] = {}
    phase: tuple[int, str] | None = None
    events = snapshot["device_traces"][0]
    last_oom = max((index for index, event in enumerate(events) if event["action"] == "oom"), default=-1)
    for block, event in enumerate(events):
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
        elif action == "oom" and block == last_oom:  # the run stopped here: its truth holds the steps before
            break
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


@dataclass(frozen=True)
class SteadyStep:
    """One recorded step as the replay hands it to the allocator model, by block identity (block: the event index).

    ``sequence``: the blocks alive at the step's start (allocated in the order the run allocated them: the
    gradients, the optimizer state and the blocks kept from earlier steps' phases, the library workspaces, after the
    rest), then the step's own allocations and frees to its end, a phase mark where each phase's marker is allocated.
    ``gradients``: each gradient the step starts with (allocated in an earlier backward, freed in this step) mapped to
    the block holding the same parameter's gradient at the step's end (the k-th of each, in allocation order).
    ``optimizer_state``: the blocks an earlier optimizer phase allocated that are alive at the step's start.
    """

    sequence: tuple[Any, ...]
    gradients: dict[int, int]
    optimizer_state: tuple[int, ...]


_PHASE_OF_MARKER = {"batch_start": "forward", "before_backward": "backward", "before_optimizer_step": "optimizer"}


def steady_step(name: str, step: int) -> SteadyStep:
    """Recorded step ``step`` of trace ``name`` as a steady step (see :class:`SteadyStep`)."""
    from lightning_vram.records import Phase

    snapshot, measured = load(name)
    markers = {marker["bytes"]: (marker["step"], marker["at"]) for marker in measured["markers"]}
    live: dict[int, int] = {}
    born: dict[int, tuple[int, str]] = {}  # block: (step, marker of the phase it was allocated in)
    nth: dict[int, int] = {}  # block: how many mallocs its phase had made before it
    sizes: dict[int, tuple[int, int]] = {}
    before: dict[int, tuple[int, int]] = {}
    body: list[Any] = []
    at: tuple[int, str] = (-1, "")
    made = 0
    events = snapshot["device_traces"][0]
    last_oom = max((index for index, event in enumerate(events) if event["action"] == "oom"), default=-1)
    for block, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            if event["size"] in markers:
                at = markers[event["size"]]
                made = 0
                if at == (step, "batch_start"):
                    before = {alive: sizes[alive] for alive in live.values()}
                if at[0] == step and at[1] in _PHASE_OF_MARKER:
                    body.append(Phase(_PHASE_OF_MARKER[at[1]]))
                if at[0] > step or at == (step, "batch_end"):
                    break
            live[event["addr"]] = block
            sizes[block] = (event["size"], event["stream"])
            born[block] = at
            nth[block] = made
            made += 1
            if at[0] == step:
                body.append(("malloc", block, event["size"], event["stream"]))
        elif action == "free_completed":
            freed = live.pop(event["addr"])
            if at[0] == step:
                body.append(("free", freed, 0, 0))
        elif action == "oom" and block == last_oom:  # as in replay_phases: earlier ones the run survived
            break
    freed_in_step = {event[1] for event in body if not isinstance(event, Phase) and event[0] == "free"}
    kept = set(live.values())
    gradients = [b for b in before if born[b][1] == "before_backward" and b in freed_in_step]
    state = [b for b in before if born[b][1] == "before_optimizer_step"]
    kept_from_steps = [b for b in before if born[b][0] >= 0 and b not in gradients and b not in state]
    rest = [b for b in before if born[b][0] < 0 or born[b][1] == "batch_end"]
    new_gradients = [b for b in kept if born[b] == (step, "before_backward")]
    new_gradients = sorted(new_gradients)[-len(gradients) :] if gradients else []
    # Kept from an earlier step's forward or backward (the libraries' workspaces): allocated where this step's same
    # phase makes as many mallocs, under a negative id, as the replay's listener gets them.
    workspaces = [b for b in kept_from_steps if b not in rest]
    for block in sorted(workspaces, key=lambda b: -nth[b]):
        marker, count = born[block][1], nth[block]
        phase = Phase(_PHASE_OF_MARKER[marker])
        position = body.index(phase) + 1
        while count > 0 and position < len(body) and not isinstance(body[position], Phase):
            count -= body[position][0] == "malloc"
            position += 1
        body.insert(position, ("malloc", -block, *before[block]))
    order = [*rest, *gradients, *state]
    sequence = (*(("malloc", b, *before[b]) for b in order), *body)
    return SteadyStep(sequence, dict(zip(gradients, new_gradients, strict=False)), tuple(state))
