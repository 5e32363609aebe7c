"""The replay's allocation sequence, as a model of the CUDA caching allocator would be driven by it.

A recording listener stands in for the model (it takes the same calls: ``malloc``, ``free``, ``reset_peaks``): the
sequence must balance, and its running sum must be the replay's own live bytes, phase peak by phase peak. On CUDA,
cuBLAS's workspaces come through the same seam, sized as torch sizes them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay._fake import FakeTensor, FakeTensorMode
from lightning_vram.prediction.replay.library_workspaces import (
    HOPPER_WORKSPACE_BYTES,
    OTHER_WORKSPACE_BYTES,
    LibraryWorkspaces,
    cublas_workspace_bytes,
)
from lightning_vram.prediction.replay.live import LiveMemory
from lightning_vram.prediction.replay.reserved import ReservedPeaks
from lightning_vram.records import Phase, ReplayedStep

MIB = 1024**2


class Recorder:
    """Records the allocation sequence; keeps the running sum and its peak since the last reset."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.events: list[tuple[str, int, int]] = []
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self.phase_peaks: list[int] = []  # the peak of each phase, read as the next one starts (and at the end)
        self.problems: list[str] = []

    def malloc(self, block: int, size: int, stream: int = 0) -> None:
        if block in self.live:
            self.problems.append(f"block {block} allocated twice")
        if size <= 0 or stream != 0:
            self.problems.append(f"block {block}: size {size}, stream {stream}")
        self.live[block] = size
        self.events.append(("malloc", block, size))
        self.allocated_bytes += size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)

    def free(self, block: int) -> None:
        if block not in self.live:
            self.problems.append(f"block {block} freed but not allocated")
            return
        self.allocated_bytes -= self.live.pop(block)
        self.events.append(("free", block, 0))

    def reset_peaks(self) -> None:
        self.events.append(("reset", 0, 0))
        self.phase_peaks.append(self.peak_allocated_bytes)
        self.peak_allocated_bytes = self.allocated_bytes


def _conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


MODELS: dict[str, tuple[Any, Any]] = {
    "mlp": (
        lambda: Classifier(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), OPTIMIZERS["adam"]),
        lambda: (torch.randn(8, 32), torch.randint(0, 10, (8,))),
    ),
    "conv-batchnorm": (
        lambda: Classifier(_conv_net(), OPTIMIZERS["sgd"]),
        lambda: (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))),
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_allocation_sequence_balances_and_sums_to_the_live_bytes_at_each_phase_peak(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    build, data = MODELS[name]
    torch.manual_seed(0)
    module, batch = build(), data()
    recorded = Recorder()
    ends: list[tuple[int, set[int], int, set[int], int]] = []

    class Ending(LiveMemory):
        """The replay's live count, read with the recorder's as the step ends (the mode exits)."""

        def __exit__(self, *args: Any) -> None:
            tracked = {key for key, size in self._sizes.items() if size > 0}
            ends.append(
                (self.live_bytes, tracked, recorded.allocated_bytes, set(recorded.live), recorded.peak_allocated_bytes)
            )
            super().__exit__(*args)

    monkeypatch.setattr("lightning_vram.prediction.predictor.LiveMemory", Ending)
    with round_of_replays():  # as every caller replays
        step = Predictor(module, None, batch, warm_up=True, allocations=lambda: recorded).baseline()
    assert isinstance(step, ReplayedStep)
    assert recorded.problems == []  # no block allocated twice, none freed that was not allocated
    ((live_bytes, tracked, running_sum, alive, last_peak),) = ends
    # Every block allocated is freed, or alive at the end of the step; the running sum is the live count then.
    assert alive == tracked and running_sum == live_bytes > 0
    # One reset as each phase starts (the first closes what existed before the step): each phase's peak of the
    # running sum is the replay's own peak of that phase.
    assert len(recorded.phase_peaks) == len(Phase) == 3
    assert [*recorded.phase_peaks[1:], last_peak] == [step.phases[phase].peak_bytes for phase in Phase]
    mallocs = [event for event in recorded.events if event[0] == "malloc"]
    frees = [event for event in recorded.events if event[0] == "free"]
    assert len(mallocs) > len(frees) > 0


def test_the_cpu_replay_emits_no_workspace_and_says_nothing_of_them() -> None:
    build, data = MODELS["conv-batchnorm"]
    recorded = Recorder()
    step = Predictor(build(), None, data(), warm_up=True, allocations=lambda: recorded).baseline()
    assert isinstance(step, ReplayedStep)
    assert recorded.events and all(block >= 0 for _, block, _ in recorded.events)
    assert not any("workspace" in note for note in step.notes)


@pytest.mark.parametrize(
    ("capability", "config", "expected"),
    [
        ((9, 0), None, 32 * MIB),
        (None, None, 32 * MIB),  # unknown: 9.0's assumed
        ((8, 0), None, 8 * MIB + 128 * 1024),
        ((8, 9), None, 8 * MIB + 128 * 1024),
        ((10, 0), None, 8 * MIB + 128 * 1024),  # torch's rule is 9.0 exactly
        ((8, 0), ":4096:8", 32 * MIB),
        ((9, 0), ":16:8", 128 * 1024),
        ((9, 0), ":4096:2:16:8", 8 * MIB + 128 * 1024),  # every :SIZE:COUNT adds up
        ((8, 0), "garbage", 8 * MIB + 128 * 1024),  # torch warns and keeps its default
        ((9, 0), ":0:0", 0),
    ],
)
def test_cublas_workspace_sizes_follow_torchs_rules(
    capability: tuple[int, int] | None, config: str | None, expected: int
) -> None:
    assert cublas_workspace_bytes(capability, config) == expected
    assert {HOPPER_WORKSPACE_BYTES, OTHER_WORKSPACE_BYTES} == {33_554_432, 8_519_680}


def test_a_cuda_replay_emits_one_cublas_workspace_per_thread_and_names_the_convolutions() -> None:
    """Fake CUDA tensors made directly (a CPU build cannot move a module there): ops run on their fake kernels."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cuda = torch.device("cuda:0")

    def fake(*shape: int) -> torch.Tensor:
        return FakeTensor(mode, torch.empty(shape, device="meta"), cuda)

    recorder = Recorder()
    workspaces = LibraryWorkspaces(recorder, (8, 0), None)
    live = LiveMemory(cuda, recorder)
    live.add_sampler(workspaces)
    weight, images, kernel = fake(64, 32), fake(2, 3, 8, 8), fake(4, 3, 3, 3)
    with mode, live:
        live.start_phase(Phase.FORWARD)
        hidden = fake(16, 32) @ weight.t()  # mm: the training thread's first matmul takes its workspace
        hidden = hidden @ fake(64, 64)  # a second matmul on that thread takes none
        torch.nn.functional.conv2d(images, kernel)
        live.start_phase(Phase.BACKWARD)
        torch.bmm(fake(2, 4, 8), fake(2, 8, 4))  # autograd's thread: its own workspace
        live.start_phase(Phase.OPTIMIZER)
        # The training thread again: it has its cuBLAS workspace; a bias epilogue takes cuBLASLt's, once.
        torch.addmm(fake(4), fake(4, 4), fake(4, 4))
        torch.addmm(fake(4), fake(4, 4), fake(4, 4))
    workspace_events = [event for event in recorder.events if event[1] < 0]
    assert workspace_events == [("malloc", -1, 8_519_680), ("malloc", -2, 8_519_680), ("malloc", -3, 1_048_576)]
    assert recorder.live[-1] == recorder.live[-2] == 8_519_680 and recorder.live[-3] == 1_048_576  # never freed
    assert workspaces.held_bytes == 2 * 8_519_680 + 1_048_576
    assert workspaces.convolutions == {"convolution"}
    (cublas, cublaslt, cudnn) = workspaces.notes
    assert cublas.startswith("cuBLAS workspaces: 2 x 8519680 bytes")
    assert cublaslt.startswith("cuBLASLt workspaces: 1 x 1048576 bytes")
    assert cudnn.startswith("cuDNN workspaces (convolution): measured, not replayed")
    unknown = LibraryWorkspaces(None, None, None)
    unknown.sample("mm")
    assert unknown.notes == (
        "cuBLAS workspaces: 1 x 33554432 bytes, one per thread that ran a matmul, allocated at its first and kept"
        " (compute capability unknown: 9.0's assumed)",
    )


def _reserved_by_hand(events: list[tuple[str, int, int]], settings: AllocatorSettings) -> list[int]:
    """The recorded sequence run through a model directly: its reserved peak in each phase (after each reset)."""
    model, peaks = CachingAllocatorModel(settings), []
    for kind, block, size in events:
        if kind == "malloc":
            model.malloc(block, size)
        elif kind == "free":
            model.free(block)
        else:
            peaks.append(model.peak_reserved_bytes)
            model.reset_peaks()
    return [*peaks[1:], model.peak_reserved_bytes]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_phase_carries_the_allocator_models_reserved_peak_where_asked_and_none_on_the_cpu(name: str) -> None:
    build, data = MODELS[name]
    torch.manual_seed(0)
    module, batch = build(), data()
    plain = Predictor(module, None, batch, warm_up=True).baseline()
    assert isinstance(plain, ReplayedStep)
    assert all(peak.reserved_bytes is None for peak in plain.phases.values())  # the CPU: no caching allocator
    recorded = Recorder()
    ended: list[int] = []

    class Ending(LiveMemory):
        def __exit__(self, *args: Any) -> None:
            ended.append(len(recorded.events))  # where the step ended in the sequence
            super().__exit__(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lightning_vram.prediction.predictor.LiveMemory", Ending)
        Predictor(module, None, batch, warm_up=True, allocations=lambda: recorded).baseline()
    for settings in (AllocatorSettings(), AllocatorSettings(expandable_segments=True)):
        simulated = Predictor(module, None, batch, warm_up=True, allocator=settings).baseline()
        assert isinstance(simulated, ReplayedStep)
        reserved = [simulated.phases[phase].reserved_bytes for phase in Phase]
        assert reserved == _reserved_by_hand(recorded.events[: ended[0]], settings)
        # Every storage here is under 1 MiB: the small pool, one 2 MiB segment (or page) holds the whole step.
        assert reserved == [2 * MIB] * 3
        assert [simulated.phases[phase].peak_bytes for phase in Phase] == [
            plain.phases[phase].peak_bytes for phase in Phase
        ]


@pytest.mark.parametrize(("capability", "reserved"), [((8, 0), 2 * MIB + 20 * MIB), ((9, 0), 2 * MIB + 64 * MIB)])
def test_cublas_workspaces_take_their_segments_in_the_reserved_peak_from_the_steps_start(
    capability: tuple[int, int], reserved: int
) -> None:
    """Both threads' workspaces are alive from the step's start, kept from earlier steps (backward's too, in the
    forward phase). 8 MiB + 128 KiB ones share one 20 MiB segment (the large pool's for requests under 10 MiB);
    32 MiB ones take a segment each. The matmuls' outputs take a 2 MiB small segment."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cuda = torch.device("cuda:0")

    def fake(*shape: int) -> torch.Tensor:
        return FakeTensor(mode, torch.empty(shape, device="meta"), cuda)

    peaks = ReservedPeaks(AllocatorSettings())
    live = LiveMemory(cuda, peaks)
    live.add_sampler(LibraryWorkspaces(peaks, capability, None))
    live.add_sampler(peaks)
    with mode, live:
        live.start_phase(Phase.FORWARD)
        fake(16, 32) @ fake(32, 64)
        live.start_phase(Phase.BACKWARD)
        torch.bmm(fake(2, 4, 8), fake(2, 8, 4))
    assert peaks.finish() == {Phase.FORWARD: reserved, Phase.BACKWARD: reserved}
