"""What other allocator settings would have held over a recorded trace, and whether its failed request would fit."""

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
    ``fits``: where the trace ran out of memory, whether the model serves the whole trace, the failed request
    included, at the capacity the recorded run had; None where the trace did not run out of memory.
    """

    setting: str
    replay: Replay
    fits: bool | None


@dataclass(frozen=True)
class WhatIf:
    """A trace replayed under the settings it ran with and under each alternative.

    ``simulated`` does what the recorded run did (its figures compare with the recorded ones); where the trace ran
    out of memory, ``serving_failed`` is the same replay serving the failed request too, as the alternatives do.
    """

    trace: SnapshotTrace
    simulated: Replay
    simulated_fits: bool | None
    serving_failed: Replay | None
    alternatives: tuple[Alternative, ...]


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


def _fits(trace: SnapshotTrace, settings: AllocatorSettings) -> bool | None:
    if trace.failed is None:
        return None
    return replay(trace, settings, trace.failed.capacity_bytes, serve_failed_request=True).out_of_memory is None


def what_if(trace: SnapshotTrace) -> WhatIf:
    """The trace replayed with its own settings (torch's defaults where the snapshot names none) and the others."""
    simulated = replay(trace)
    serve = trace.failed is not None
    tried = tuple(
        Alternative(label, replay(trace, settings, serve_failed_request=serve), _fits(trace, settings))
        for label, settings in alternatives(simulated.settings)
    )
    serving = replay(trace, serve_failed_request=True) if serve else None
    return WhatIf(trace, simulated, _fits(trace, simulated.settings), serving, tried)
