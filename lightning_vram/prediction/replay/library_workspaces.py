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

cuBLASLt: the first matmul with a fused bias epilogue (``addmm`` with a bias vector, as ``nn.Linear`` calls it) of a
thread takes cuBLASLt's own workspace too, ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024), kept likewise
(:func:`cublaslt_workspace_bytes`). Seen in the allocator's traces of real steps (torch 2.11, H200 and H100): the
training thread's first ``addmm`` allocates 32 MiB then 1 MiB, both kept to the end; autograd's thread, whose
backward matmuls are plain ``mm``, only its 32 MiB. A 1 MiB request is served from the small pool's 2 MiB segments.

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

LT_OPS = frozenset({"addmm", "_addmm_activation"})
"""aten ops that run on cuBLASLt (a matmul with a fused bias epilogue), whose first on a thread takes its workspace."""
DEFAULT_LT_WORKSPACE_KIB = 1024
"""cuBLASLt's workspace where ``CUBLASLT_WORKSPACE_SIZE`` is unset (torch's ``parseCUDABlasLtWorkspaceSize``), KiB."""

_CONFIG_ENTRY = re.compile(r":([0-9]+):([0-9]+)")
"""One ``:SIZE:COUNT`` of ``CUBLAS_WORKSPACE_CONFIG`` (SIZE in KiB), as torch's regular expression reads it."""

_HANDLE_BLOCKS = {Phase.FORWARD: -1, Phase.OPTIMIZER: -1, Phase.BACKWARD: -2}
"""The workspace block of each phase's thread: the training thread's (-1), autograd's device thread's (-2)."""
_LT_BLOCKS = {Phase.FORWARD: -3, Phase.OPTIMIZER: -3, Phase.BACKWARD: -4}
"""The cuBLASLt workspace block of each phase's thread, as :data:`_HANDLE_BLOCKS`."""


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


def cublaslt_workspace_bytes(config: str | None) -> int:
    """The bytes of one cuBLASLt workspace: ``CUBLASLT_WORKSPACE_SIZE`` KiB (``None`` or not a number: 1024 KiB).

    >>> cublaslt_workspace_bytes(None), cublaslt_workspace_bytes("4096"), cublaslt_workspace_bytes("lots")
    (1048576, 4194304, 1048576)
    """
    try:
        kib = int(config) if config is not None else DEFAULT_LT_WORKSPACE_KIB
    except ValueError:  # torch warns and keeps its default
        kib = DEFAULT_LT_WORKSPACE_KIB
    return kib * KIB


class LibraryWorkspaces:
    """The library workspaces of one CUDA replay: cuBLAS's emitted to ``allocations``, cuDNN's convolutions named.

    Args:
        allocations: told of each cuBLAS workspace (``None``: only the ops are noted).
        compute_capability: the device's (``None``: unknown, :data:`DEFAULT_COMPUTE_CAPABILITY` assumed, and
            :attr:`notes` says so).
        config: ``CUBLAS_WORKSPACE_CONFIG`` as the run has it (``None``: unset).
        lt_config: ``CUBLASLT_WORKSPACE_SIZE`` as the run has it (``None``: unset).
    """

    def __init__(
        self,
        allocations: AllocationListener | None,
        compute_capability: tuple[int, int] | None,
        config: str | None,
        lt_config: str | None = None,
    ) -> None:
        self._allocations = allocations
        self._assumed = compute_capability is None
        self.cublas_bytes = cublas_workspace_bytes(compute_capability, config)
        """The bytes of each cuBLAS workspace."""
        self.cublaslt_bytes = cublaslt_workspace_bytes(lt_config)
        """The bytes of each cuBLASLt workspace."""
        self.cublas_blocks: list[int] = []
        """The workspaces emitted, by block (one per thread that ran a matmul)."""
        self.cublaslt_blocks: list[int] = []
        """The cuBLASLt workspaces emitted, by block (one per thread that ran a matmul with a bias epilogue)."""
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
        self._take(_HANDLE_BLOCKS[self._phase], self.cublas_blocks, self.cublas_bytes)
        if op in LT_OPS:
            self._take(_LT_BLOCKS[self._phase], self.cublaslt_blocks, self.cublaslt_bytes)

    def _take(self, block: int, taken: list[int], size: int) -> None:
        """Emit workspace ``block`` of ``size`` bytes unless its thread took it already."""
        if block in taken:
            return
        taken.append(block)
        if self._allocations is not None:
            self._allocations.malloc(block, size)

    @property
    def held_bytes(self) -> int:
        """Every workspace emitted, in bytes: what a steady step holds from its start (earlier steps took them)."""
        return len(self.cublas_blocks) * self.cublas_bytes + len(self.cublaslt_blocks) * self.cublaslt_bytes

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
        if self.cublaslt_blocks:
            notes.append(
                f"cuBLASLt workspaces: {len(self.cublaslt_blocks)} x {self.cublaslt_bytes} bytes, one per thread that"
                " ran a matmul with a bias epilogue, allocated at its first and kept"
            )
        if self.convolutions:
            notes.append(
                f"cuDNN workspaces ({', '.join(sorted(self.convolutions))}): measured, not replayed (cuDNN sizes them"
                " by the algorithm it picks on the device)"
            )
        return tuple(notes)
