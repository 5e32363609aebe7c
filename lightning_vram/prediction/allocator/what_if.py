"""What other allocator settings would have held over a recorded trace, and whether it would fit at a capacity.

The capacity is the one given (``lightning-vram allocator --capacity``: another card), else, where the trace ran out
of memory, the one its run had; a trace that did not run out of memory, with no capacity given, is judged at none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_vram.prediction.allocator.settings import MIB, AllocatorSettings
from lightning_vram.prediction.allocator.snapshot import Replay, SnapshotTrace, replay

MAX_SPLIT_SIZES_MB = (64, 128, 256, 512)
"""The ``max_split_size_mb`` values tried: the range PyTorch's memory notes suggest for fragmented runs."""


@dataclass(frozen=True)
class Alternative:
    """One setting changed from the recorded run's, and what the model held with it.

    ``replay`` has no capacity and, where the trace ran out of memory, serves the request that failed too.
    ``judged``: the same at the capacity judged at (:attr:`WhatIf.capacity_bytes`); None where there is none.
    """

    setting: str
    replay: Replay
    judged: Replay | None

    @property
    def fits(self) -> bool | None:
        """Whether the model serves the whole trace (the failed request included) at the capacity judged at."""
        return None if self.judged is None else self.judged.out_of_memory is None


@dataclass(frozen=True)
class WhatIf:
    """A trace replayed under the settings it ran with and under each alternative.

    ``simulated`` does what the recorded run did (its figures compare with the recorded ones); where the trace ran
    out of memory, ``serving_failed`` is the same replay serving the failed request too, as the alternatives do.
    ``capacity_bytes``: the capacity judged at (``capacity_given``: the one asked for, not the run's); None where
    there is none. ``simulated_judged``: the run's settings at that capacity, serving the failed request too.
    """

    trace: SnapshotTrace
    simulated: Replay
    simulated_judged: Replay | None
    serving_failed: Replay | None
    alternatives: tuple[Alternative, ...]
    capacity_bytes: int | None
    capacity_given: bool

    @property
    def simulated_fits(self) -> bool | None:
        """Whether the run's own settings serve the whole trace at the capacity judged at; None where there is none."""
        return None if self.simulated_judged is None else self.simulated_judged.out_of_memory is None


def alternatives(settings: AllocatorSettings) -> tuple[tuple[str, AllocatorSettings], ...]:
    """The settings tried beside ``settings``: expandable segments switched, then each ``max_split_size_mb``.

    >>> [label for label, _ in alternatives(AllocatorSettings())][:2]
    ['expandable_segments:True', 'max_split_size_mb:64']
    """
    switched = not settings.expandable_segments
    tried = [(f"expandable_segments:{switched}", replace(settings, expandable_segments=switched))]
    for megabytes in MAX_SPLIT_SIZES_MB:
        if settings.max_split_size_bytes != megabytes * MIB:
            tried.append((f"max_split_size_mb:{megabytes}", replace(settings, max_split_size_bytes=megabytes * MIB)))
    return tuple(tried)


def what_if(trace: SnapshotTrace, capacity_bytes: int | None = None) -> WhatIf:
    """The trace replayed with its own settings (torch's defaults where the snapshot names none) and the others.

    ``capacity_bytes``: the device memory to judge each at (bytes); None: the recorded run's, where it ran out.
    """
    judged_at = capacity_bytes
    if judged_at is None and trace.failed is not None:
        judged_at = trace.failed.capacity_bytes
    simulated = replay(trace)
    serve = trace.failed is not None

    def judged(settings: AllocatorSettings) -> Replay | None:
        return None if judged_at is None else replay(trace, settings, judged_at, serve_failed_request=serve)

    tried = tuple(
        Alternative(label, replay(trace, settings, serve_failed_request=serve), judged(settings))
        for label, settings in alternatives(simulated.settings)
    )
    serving = replay(trace, serve_failed_request=True) if serve else None
    return WhatIf(trace, simulated, judged(simulated.settings), serving, tried, judged_at, capacity_bytes is not None)
