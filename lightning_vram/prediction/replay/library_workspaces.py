"""Library workspaces a CUDA step takes from the caching allocator, which no tensor of the replay shows.

cuBLAS: torch gives each cuBLAS handle and stream its own workspace, allocated through the caching allocator the
first time the handle runs a matmul and kept for the process (``aten/src/ATen/cuda/CublasHandlePool.cpp``:
``getNewWorkspace``, ``setWorkspaceForHandle``). Its size is ``CUBLAS_WORKSPACE_CONFIG`` where set, else 32 MiB on
compute capability 9.0 and 8 MiB + 128 KiB on every other (:func:`cublas_workspace_bytes`). Handles are per thread:
the training thread's (forward, optimizer step) and autograd's device thread's (backward) are two, so a step holds
up to two workspaces. :class:`LibraryWorkspaces` (a sampler of the replay's
:class:`~lightning_vram.prediction.replay.live.LiveMemory`) emits each, once, as an allocation that is never freed,
at the first matmul-family op of its thread (the reserved simulation,
:mod:`~lightning_vram.prediction.replay.reserved`, counts them from the step's start: earlier steps allocated them).

cuDNN sizes its convolution workspaces per call, by the algorithm it picks on the device: they cannot be sized
here. A replay names the convolution ops it met, so that the report can say they are measured, not replayed.
"""

from __future__ import annotations

import re

from lightning_vram.prediction.replay.live import AllocationListener
from lightning_vram.records import Phase

KIB = 1024
DEFAULT_COMPUTE_CAPABILITY = (9, 0)
"""The compute capability assumed where the device's is unknown (an H100's or H200's: the larger workspace)."""

HOPPER_WORKSPACE_BYTES = 4096 * 8 * KIB
"""cuBLAS's workspace on compute capability 9.0 (32 MiB), per handle and stream."""
OTHER_WORKSPACE_BYTES = 4096 * KIB * 2 + 16 * KIB * 8
"""cuBLAS's workspace on every other compute capability (``:4096:2:16:8``: 8 MiB + 128 KiB), per handle and
stream."""

MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_scaled_mm"}
)
"""aten ops (no namespace, no overload) that run on cuBLAS; ``matmul`` and ``linear`` reach them decomposed."""
CONVOLUTION_OPS = frozenset(
    {"convolution", "convolution_backward", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose"}
)
"""aten ops that run on cuDNN with a workspace of its choosing."""

_CONFIG_ENTRY = re.compile(r":([0-9]+):([0-9]+)")
"""One ``:SIZE:COUNT`` of ``CUBLAS_WORKSPACE_CONFIG`` (SIZE in KiB), as torch's regular expression reads it."""

_HANDLE_BLOCKS = {Phase.FORWARD: -1, Phase.OPTIMIZER: -1, Phase.BACKWARD: -2}
"""The workspace block of each phase's thread: the training thread's (-1), autograd's device thread's (-2)."""


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, config: str | None) -> int:
    """The bytes of one cuBLAS workspace, as torch's ``parseChosenWorkspaceSize`` works them out.

    ``config`` is ``CUBLAS_WORKSPACE_CONFIG`` (``None``: unset): the sum of SIZE KiB x COUNT over its ``:SIZE:COUNT``
    entries; one without any entry gives the default, as torch does (with a warning). ``compute_capability``:
    the device's (``None``: :data:`DEFAULT_COMPUTE_CAPABILITY`).

    >>> cublas_workspace_bytes((9, 0), None), cublas_workspace_bytes((8, 0), None)
    (33554432, 8519680)
    >>> cublas_workspace_bytes((8, 0), ":4096:8"), cublas_workspace_bytes((9, 0), ":16:8:4096:2")
    (33554432, 8519680)
    """
    major, minor = compute_capability or DEFAULT_COMPUTE_CAPABILITY
    default = HOPPER_WORKSPACE_BYTES if (major, minor) == (9, 0) else OTHER_WORKSPACE_BYTES
    if config is None:
        return default
    entries = _CONFIG_ENTRY.findall(config)
    if not entries:
        return default
    return sum(int(size) * KIB * int(count) for size, count in entries)


class LibraryWorkspaces:
    """The library workspaces of one CUDA replay: cuBLAS's emitted to ``allocations``, cuDNN's convolutions named.

    Args:
        allocations: told of each cuBLAS workspace (``None``: only the ops are noted).
        compute_capability: the device's (``None``: unknown, :data:`DEFAULT_COMPUTE_CAPABILITY` assumed, and
            :attr:`notes` says so).
        config: ``CUBLAS_WORKSPACE_CONFIG`` as the run has it (``None``: unset).
    """

    def __init__(
        self,
        allocations: AllocationListener | None,
        compute_capability: tuple[int, int] | None,
        config: str | None,
    ) -> None:
        self._allocations = allocations
        self._assumed = compute_capability is None
        self.cublas_bytes = cublas_workspace_bytes(compute_capability, config)
        """The bytes of each cuBLAS workspace."""
        self.cublas_blocks: list[int] = []
        """The workspaces emitted, by block (one per thread that ran a matmul)."""
        self.convolutions: set[str] = set()
        """The cuDNN convolution ops met, whose workspaces are not replayed."""
        self._phase = Phase.FORWARD

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts now: its ops run on its thread's handle."""
        self._phase = phase

    def sample(self, op: str) -> None:
        """Op ``op`` (no namespace, no overload) ran: a first matmul of its thread takes a workspace."""
        if op in CONVOLUTION_OPS:
            self.convolutions.add(op)
        if op not in MATMUL_OPS:
            return
        block = _HANDLE_BLOCKS[self._phase]
        if block in self.cublas_blocks:
            return
        self.cublas_blocks.append(block)
        if self._allocations is not None:
            self._allocations.malloc(block, self.cublas_bytes)

    @property
    def notes(self) -> tuple[str, ...]:
        """What the replay says of the workspaces: cuBLAS's as replayed, cuDNN's as measured, not replayed."""
        notes: list[str] = []
        if self.cublas_blocks:
            assumed = " (compute capability unknown: 9.0's assumed)" if self._assumed else ""
            notes.append(
                f"cuBLAS workspaces: {len(self.cublas_blocks)} x {self.cublas_bytes} bytes, one per thread that ran a"
                f" matmul, allocated at its first and kept{assumed}"
            )
        if self.convolutions:
            notes.append(
                f"cuDNN workspaces ({', '.join(sorted(self.convolutions))}): measured, not replayed (cuDNN sizes them"
                " by the algorithm it picks on the device)"
            )
        return tuple(notes)
