"""The first step before a replayed steady step: by hand, and on the recorded GPU traces.

Each trace's steps 1 and 2 are cut by block identity (each ``alloc`` a new block, a ``free_completed`` freeing the
live block at its address); the steps before each are synthesised from it (the first) and run before it, and the
phases' reserved peaks set against the recorded ones; ``pytest -s`` prints the table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from allocator_traces import SHIPPED, load, run_settings, steady_step
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.history import with_first_step
from lightning_vram.prediction.replay.reserved import ReservedPeaks, phase_peaks
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import AllocationSequence, Phase, ReplayedStep

MIB = 1024 * 1024
PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def _record(reserved: ReservedPeaks, step: AllocationSequence) -> None:
    for event in step:
        if isinstance(event, Phase):
            reserved.start_phase(event)
        elif event[0] == "malloc":
            reserved.malloc(event[1], event[2], event[3])
        else:
            reserved.free(event[1])


# Sizes of 10 MiB and more get a segment of their size (a multiple of 2 MiB: exactly); a cached block is split where
# more than 1 MiB would remain.
STEP = (
    ("malloc", 1, 20 * MIB, 0),  # a parameter
    ("malloc", 2, 20 * MIB, 0),  # its gradient, from the last step
    ("malloc", 3, 40 * MIB, 0),  # optimizer state
    Phase.FORWARD,
    ("malloc", 4, 60 * MIB, 0),  # an activation
    ("free", 2, 0, 0),  # zero_grad
    Phase.BACKWARD,
    ("malloc", 5, 20 * MIB, 0),  # the new gradient
    ("free", 4, 0, 0),
    Phase.OPTIMIZER,
    ("malloc", 6, 20 * MIB, 0),  # the update's temporary
    ("free", 6, 0, 0),
)


def test_the_first_step_leaves_the_state_in_the_activations_segment() -> None:
    reserved = ReservedPeaks(AllocatorSettings())
    _record(reserved, STEP)
    reserved.starts_with({2: 5}, [3])
    # First step: the parameter (a 20 MiB segment), the activation (60), the gradient (a new 20: nothing is cached),
    # the activation freed; the state takes 40 of its 60 MiB segment (20 remain, cached), the temporary those 20.
    # Held: 100 MiB. Step 1: the activation finds no 60 MiB block (a new segment: 160), the gradient and the
    # temporary take cached 20 MiB blocks; step 2 (the one read) holds those 160 MiB from its start. Packed
    # (parameter, gradient and state first: 80 MiB) the step would hold 140 MiB: its activation's new segment, the
    # gradient in the old one's place, the temporary split from the activation's segment once freed.
    assert reserved.finish() == {phase: 160 * MIB for phase in PHASES}
    packed = phase_peaks(STEP, AllocatorSettings())
    assert packed == {phase: 140 * MIB for phase in PHASES}


def test_the_history_keeps_block_identity_and_hands_the_step_its_starting_blocks() -> None:
    sequence = with_first_step(STEP, {2: 5}, [3])
    history, steady = sequence[: -len(STEP) + 3], sequence[-len(STEP) + 3 :]
    assert steady == STEP[3:]
    model = CachingAllocatorModel()
    for event in history:  # every malloc a block not live, every free one that is
        if not isinstance(event, Phase):
            if event[0] == "malloc":
                model.malloc(event[1], event[2], event[3])
            else:
                model.free(event[1])
    # What the step starts with, and nothing else: the parameter, the gradient the first step made, the state.
    assert model.allocated_bytes == 80 * MIB
    state = history.index(("malloc", 3, 40 * MIB, 0))
    assert history[state - 1] is Phase.OPTIMIZER  # allocated where the optimizer phase starts


def test_a_step_without_an_optimizer_phase_keeps_its_state_before_it() -> None:
    step = (("malloc", 1, 20 * MIB, 0), ("malloc", 3, 40 * MIB, 0), Phase.FORWARD, ("malloc", 4, 60 * MIB, 0))
    sequence = with_first_step(step, {}, [3])
    assert sequence[:2] == step[:2]  # the state, as the step has it, before the first step
    assert sequence[-2:] == (Phase.FORWARD, ("malloc", 4, 60 * MIB, 0))
    assert ("free", 5, 0, 0) in sequence  # the first step's activation, not alive at the step's start


def test_a_workspace_is_allocated_where_the_first_step_used_it_and_kept() -> None:
    step = (("malloc", 1, 20 * MIB, 0), Phase.FORWARD, ("malloc", 4, 60 * MIB, 0), ("malloc", -1, 32 * MIB, 0))
    sequence = with_first_step(step, {}, [], steps=2)
    assert sequence.count(("malloc", -1, 32 * MIB, 0)) == 1
    assert sequence[-2:] == (Phase.FORWARD, ("malloc", 4, 60 * MIB, 0))


RECORDED_STEPS = [(name, step) for name in SHIPPED for step in (1, 2) if len(load(name)[1]["truth"]) > step]
"""The traces' complete steps past step 0 (the H100's at the capacity the run had: ``free_at_start_bytes``); the
runs that ran out of memory have none or step 0 only."""


def _phase_peaks_at(sequence: AllocationSequence, settings: AllocatorSettings, capacity: int | None) -> dict[str, int]:
    model = CachingAllocatorModel(settings, capacity_bytes=capacity)
    peaks: dict[str, int] = {}
    phase: Phase | None = None
    for event in sequence:
        if isinstance(event, Phase):
            if phase is not None:
                peaks[phase.value] = max(peaks.get(phase.value, 0), model.peak_reserved_bytes)
            phase = event
            model.reset_peaks()
        elif event[0] == "malloc":
            model.malloc(event[1], event[2], event[3])
        else:
            model.free(event[1])
    assert phase is not None
    peaks[phase.value] = max(peaks.get(phase.value, 0), model.peak_reserved_bytes)
    return peaks


@pytest.mark.parametrize(("name", "number"), RECORDED_STEPS)
def test_a_recorded_step_s_reserved_peaks_come_after_the_synthesised_first_step(name: str, number: int) -> None:
    measured = load(name)[1]
    recorded = {phase.value: measured["truth"][number][phase.value]["reserved_peak"] for phase in PHASES}
    step = steady_step(name, number)
    capacity = measured.get("free_at_start_bytes")
    history = with_first_step(step.sequence, step.gradients, step.optimizer_state, number)
    peaks = _phase_peaks_at(history, run_settings(name), capacity)
    print(f"\n{name} step {number} reserved MiB (recorded, after the first step and {number - 1} more)")
    for phase, bytes_ in recorded.items():
        print(f"  {phase:<10} {bytes_ / MIB:>10,.0f} {peaks[phase] / MIB:>10,.0f} {peaks[phase] / bytes_ - 1:+.2%}")
    # Uncapped, each phase within 0.1% (the recorded H200 traces: 2 MiB or less); at the capacity, where the run
    # released its cache and retried, 1% (ResNet-50 at batch 952: backward 0.95% over).
    tolerance = 1e-2 if capacity is not None else 1e-3
    assert peaks == {phase: pytest.approx(bytes_, rel=tolerance) for phase, bytes_ in recorded.items()}


@pytest.mark.parametrize("name", ["gpt2-b150", "resnet50-b64"])
def test_the_packed_step_alone_misses_step_one(name: str) -> None:
    # Today's figures without the first step: 10.7% and 14.8% under on forward (the check the test above answers).
    measured = load(name)[1]
    step = steady_step(name, 1)
    first = step.sequence.index(Phase.FORWARD)
    workspaces = tuple(event for event in step.sequence[first:] if not isinstance(event, Phase) and event[1] < 0)
    packed = (*step.sequence[:first], *workspaces, *(e for e in step.sequence[first:] if e not in workspaces))
    forward = _phase_peaks_at(packed, run_settings(name), None)["forward"]
    assert forward < 0.9 * measured["truth"][1]["forward"]["reserved_peak"]


def test_gpt2_at_batch_91_runs_out_of_memory_in_step_one_where_the_h100_did() -> None:
    # The H100's two runs at batch 91 asked for the same tensors; the default allocator's ran out of memory in step
    # 1's backward (9,366,296,576 B asked for), the expandable one's fit. Step 1 of the expandable run, served at the
    # device's capacity: packed, both fit; after the synthesised first step (and after two steps, as the replay
    # runs it), the default allocator fails at that request with 81,505,812,480 B reserved, as the recorded trace's
    # own replay does, and expandable segments fit.
    step = steady_step("h100-gpt2-b91-expandable", 1)
    available = load("h100-gpt2-b91")[1]["free_at_start_bytes"]
    first = step.sequence.index(Phase.FORWARD)
    workspaces = tuple(event for event in step.sequence[first:] if not isinstance(event, Phase) and event[1] < 0)
    packed = (*step.sequence[:first], *workspaces, *(e for e in step.sequence[first:] if e not in workspaces))
    default, expandable = AllocatorSettings(), AllocatorSettings(expandable_segments=True)
    assert serve(packed, default, available).served and serve(packed, expandable, available).served
    reserved = ReservedPeaks(default)  # as the replay hands it the step
    _record(reserved, step.sequence)
    reserved.starts_with(step.gradients, step.optimizer_state)
    for history in (with_first_step(step.sequence, step.gradients, step.optimizer_state), reserved.sequence()):
        shortfall = serve(history, default, available).shortfall
        assert shortfall is not None and shortfall.phase is Phase.BACKWARD
        assert (shortfall.requested_bytes, shortfall.reserved_bytes) == (9_366_296_576, 81_505_812_480)
        assert serve(history, expandable, available).served


def test_the_replay_hands_its_step_s_gradients_and_optimizer_state_to_the_history() -> None:
    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), OPTIMIZERS["adam"])
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    with round_of_replays():  # warmed up: the step starts with gradients and Adam's state
        step = Predictor(module, None, batch, warm_up=True, allocator=AllocatorSettings()).baseline()
    assert isinstance(step, ReplayedStep) and step.allocations is not None
    sequence = step.allocations
    marks = [index for index, event in enumerate(sequence) if isinstance(event, Phase)]
    assert [sequence[index] for index in marks] == [*PHASES] * 3  # the first step, step 1, the replayed step
    parameters = [64 * 256 * 4, 256 * 4, 256 * 10 * 4, 10 * 4]
    # Before the first step: the parameters and the batch, no gradient, no state.
    assert [event[2] for event in sequence[: marks[0]]] == [*parameters, 32 * 64 * 4, 32 * 8]
    # Adam's state where the first optimizer phase starts, per parameter as torch's _init_group makes it: its step
    # (on the counted device here: the CPU), exp_avg, exp_avg_sq.
    state = sequence[marks[2] + 1 : marks[2] + 1 + 3 * len(parameters)]
    assert [(event[0], event[2]) for event in state] == [
        ("malloc", size) for parameter in parameters for size in (4, parameter, parameter)
    ]


def test_a_replayed_step_that_makes_the_optimizer_state_is_the_run_s_first_and_runs_alone() -> None:
    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), OPTIMIZERS["adam"])
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    with round_of_replays():  # not warmed up: the replayed step makes the gradients and Adam's state itself
        step = Predictor(module, None, batch, allocator=AllocatorSettings()).baseline()
    assert isinstance(step, ReplayedStep) and step.allocations is not None
    assert [event for event in step.allocations if isinstance(event, Phase)] == [*PHASES]


def test_a_step_sampled_before_the_steady_state_is_set_against_its_own_reserve() -> None:
    """A steady step (the run's step 2 on) is what a fit stands on; a monitor that samples step 1 measures less
    reserved in forward (step 1 starts with the first step's reserve only). On an H100, GPT-2 124M's sampled step 1
    read 8,946 MiB in forward, the replay (a steady step's) 9,732 MiB: calibration set one against the other."""
    name = "gpt2-b8"
    truth = load(name)[1]["truth"]
    step = steady_step(name, 2)
    reserved = ReservedPeaks(run_settings(name))
    _record(reserved, step.sequence)
    reserved.starts_with(step.gradients, step.optimizer_state)
    steady, first_sampled = reserved.finish(), reserved.finish(steps_before=1)
    for number, peaks in ((2, steady), (1, first_sampled)):
        recorded = {phase: truth[number][phase.value]["reserved_peak"] for phase in PHASES}
        assert peaks == {phase: pytest.approx(bytes_, rel=1e-3) for phase, bytes_ in recorded.items()}
    assert first_sampled[Phase.FORWARD] < steady[Phase.FORWARD]  # 7,872 MiB against 8,658 MiB recorded
    assert reserved.finish(steps_before=5) == steady  # never more history than a steady step's


class _FlatMomentum(torch.optim.Optimizer):
    """SGD momentum whose buffers are views of one flat buffer, made on the first step (one block, many entries)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def step(self, closure: Any = None) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if params and not self.state[params[0]]:
            flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
            offset = 0
            for p in params:
                self.state[p]["momentum"] = flat[offset : offset + p.numel()].view_as(p)
                self.state[p]["steps"] = 0  # a Python number beside the tensors
                offset += p.numel()
        for p in params:
            self.state[p]["momentum"].mul_(0.9).add_(p.grad)
            self.state[p]["steps"] += 1
            p.add_(self.state[p]["momentum"], alpha=-0.01)


class _KeepsItsGradient(torch.optim.Optimizer):
    """Holds each parameter's gradient itself in its state, and the parameter too (blocks the step does not make)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()  # type: ignore[untyped-decorator]
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].update(last_gradient=p.grad, parameter=p, again=p.grad)
                    p.add_(p.grad, alpha=-0.01)


@pytest.mark.parametrize("optimizer", [_FlatMomentum, _KeepsItsGradient])
def test_optimizer_state_sharing_blocks_is_replayed_with_its_history(optimizer: type[torch.optim.Optimizer]) -> None:
    # Before, the history made a shared block once per entry naming it, and the replay was skipped: "the step failed
    # under fake tensors: ValueError: block ... is already allocated" (it replayed before the history came).
    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), optimizer)
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    with round_of_replays():
        step = Predictor(module, None, batch, warm_up=True, allocator=AllocatorSettings()).baseline()
    assert isinstance(step, ReplayedStep) and step.allocations is not None
    assert all(peak.reserved_bytes for peak in step.phases.values())
    model = CachingAllocatorModel()  # every malloc of the history a block not live, every free one that is
    for event in step.allocations:
        if not isinstance(event, Phase):
            if event[0] == "malloc":
                model.malloc(event[1], event[2], event[3])
            else:
                model.free(event[1])


def test_a_block_named_twice_or_also_a_gradient_is_made_once() -> None:
    sequence = with_first_step(STEP, {2: 5}, [3, 3, 2])
    mallocs = [event[1] for event in sequence if not isinstance(event, Phase) and event[0] == "malloc"]
    assert mallocs.count(3) == 1 and mallocs.count(2) == 1
