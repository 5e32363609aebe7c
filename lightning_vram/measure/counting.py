"""How a step is counted: what differs between a sampled step of the real training and a replayed one."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_vram.measure.storages import DATA_POINTER, StorageKey


@dataclass(frozen=True)
class Counting:
    """What differs between counting a sampled step of the real training and a step replayed under fake tensors."""

    key_of: StorageKey
    """Storage -> its key (0 for one that holds nothing): a data pointer, or a ``StorageWeakRef`` identity."""
    watch_recomputation: bool
    """Whether the counter pushes a dispatch mode of its own to see what a recomputation creates; otherwise the
    caller hands it every operator's output (``StepAttributor.on_output``)."""
    raise_errors: bool
    """Whether an error inside the hooks propagates; otherwise it is kept in ``error`` and the hooks stand aside."""


SAMPLED = Counting(DATA_POINTER, watch_recomputation=True, raise_errors=False)
"""A sampled step of the user's training: real storages, and the monitor never breaks the step."""
