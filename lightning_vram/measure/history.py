"""torch's CUDA allocator history, for an out-of-memory snapshot that opens in PyTorch's memory visualizer.

The recording functions are private in torch (``torch.cuda.memory._record_memory_history``, ``_snapshot``),
documented in "Understanding CUDA Memory Usage"; this module is the only one that calls them, behind a version
check.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

MIN_TORCH_VERSION = (2, 1)
SNAPSHOT_PICKLE_PROTOCOL = 4


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(filter(str.isdigit, minor)) or 0)


def unavailable_reason() -> str | None:
    """Why the allocator history cannot be recorded here, or ``None`` when it can."""
    if _torch_version() < MIN_TORCH_VERSION:
        return f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH_VERSION))}"
    if not torch.cuda.is_available():
        return "no CUDA device: the allocator history exists only for CUDA memory"
    return None


def start_recording(max_entries: int) -> None:
    """Record every allocation and free with its Python stack (no C++ frames), keeping ``max_entries`` events."""
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)


def stop_recording() -> None:
    """Stop recording and drop the history."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_snapshot(path: Path) -> Path:
    """Write the allocator's state and history as a pickle (protocol 4) for https://pytorch.org/memory_viz."""
    snapshot = torch.cuda.memory._snapshot()
    with path.open("wb") as file:
        pickle.dump(snapshot, file, protocol=SNAPSHOT_PICKLE_PROTOCOL)
    return path
