"""Of each live peak of a gloo rank's sampled step, the peak without gloo's copy of each reduce-scatter input, for the
ground-truth runs that set one process's prediction against each rank's measured step.

Gloo has no reduce-scatter of its own: ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` (what
``dist.reduce_scatter_single`` reaches, torch 2.13) clones the whole input on the calling thread, all-reduces the
clone and copies this rank's chunk into the output; NCCL reduce-scatters the input in place, and torch's fake
process group (the replay's) allocates nothing. The clone is a storage of the input's size the live count first
sees inside ``dist.reduce_scatter_single`` (its ``copy_``), and holds until the work lets go of it: under FSDP2 the
size of a unit's padded reduce-scatter input (docs/measurement.md, "Why an FSDP2 gloo rank's backward peak has
more than its replay"). Memory no GPU run has, so it is left out of the measured figure the prediction is held to,
and only it: each phase's highest live bytes less the clones alive at that instant, tracked beside the monitor's
own count in this rank's process (``LiveTensors`` watched, not changed; the step computes what it computes).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch.distributed as dist

from lightning_vram.measure import live
from lightning_vram.measure.storages import storage_identity
from lightning_vram.records import Phase


def peaks_without_gloo_clones() -> dict[str, int]:
    """A dictionary that gets, as each phase's segment closes, its highest live bytes less gloo's reduce-scatter
    clones alive at each instant (each phase's highest over its segments). Call once per rank process, before
    training."""
    peaks: dict[str, int] = {}
    inside = threading.local()
    clones: dict[int, int] = {}  # each clone storage's key, its bytes, while counted
    segment = {"peak": 0}
    reduce_scatter = dist.reduce_scatter_single

    @functools.wraps(reduce_scatter)
    def watched(*args: Any, **kwargs: Any) -> Any:
        inside.on = True
        try:
            return reduce_scatter(*args, **kwargs)
        finally:
            inside.on = False

    dist.reduce_scatter_single = watched  # what FSDP2's foreach_reduce calls (torch 2.13)

    tracker = live.LiveTensors
    add, new_peak, start, close = tracker._add, tracker._new_peak, tracker.start, tracker.close_segment

    def without_clones(self: live.LiveTensors) -> int:
        for key in [key for key in clones if key not in self._sizes]:
            del clones[key]  # freed
        return self.live_bytes - sum(clones.values())

    def _add(self: live.LiveTensors, storage: Any, written: bool = False) -> None:
        key = storage_identity(storage)
        first = key not in self._sizes
        add(self, storage, written)
        if first and getattr(inside, "on", False) and key in self._sizes:
            clones[key] = self._sizes[key]

    def _new_peak(self: live.LiveTensors) -> None:
        new_peak(self)
        segment["peak"] = max(segment["peak"], without_clones(self))

    def _start(self: live.LiveTensors) -> None:
        start(self)
        segment["peak"] = without_clones(self)

    def close_segment(self: live.LiveTensors, phase: Phase) -> None:
        close(self, phase)
        peaks[phase.value] = max(peaks.get(phase.value, 0), segment["peak"])
        segment["peak"] = without_clones(self)

    tracker._add, tracker._new_peak = _add, _new_peak  # type: ignore[method-assign]
    tracker.start, tracker.close_segment = _start, close_segment  # type: ignore[method-assign]
    return peaks
