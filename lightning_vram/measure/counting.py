"""How a step is counted: what differs between a sampled step of the real training and a replayed one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counting:
    """What differs between counting a sampled step of the real training and a step replayed under fake tensors."""

    watch_recomputation: bool
    """Whether the counter pushes a dispatch mode of its own to see what a recomputation creates; otherwise the
    caller hands it every operator's output (``StepAttributor.on_output``)."""
    raise_errors: bool
    """Whether an error inside the hooks propagates; otherwise it is kept in ``error`` and the hooks stand aside."""


SAMPLED = Counting(watch_recomputation=True, raise_errors=False)
"""A sampled step of the user's training: real storages, and the monitor never breaks the step.

Storages are known by identity, not by data pointer: autograd may hold a storage whose data was freed
(``resize_(0)``: FSDP1's gathered flat parameters after forward), whose address the next allocation reuses; keyed
by address, that allocation was taken for the saved storage and counted once or not, as the allocator placed it
(FSDP1's activations on gloo differed from run to run: 487,208, 571,944 and 621,096 bytes for one rank)."""
