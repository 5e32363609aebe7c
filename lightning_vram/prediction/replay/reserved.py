"""The reserved memory of a replayed step: a model of the CUDA caching allocator driven by the replay, per phase.

:class:`ReservedPeaks` takes the replay's allocation sequence (an
:class:`~lightning_vram.prediction.replay.live.AllocationListener`, cuBLAS's workspaces included, with the phases'
starts) and runs it through a :class:`~lightning_vram.prediction.allocator.model.CachingAllocatorModel`, reading the
model's reserved peak as each phase ends, before the phase boundary resets the peaks (as the monitor reads torch's
counters on a sampled step).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.records import AllocationEvent, AllocationSequence, Phase


def run_settings(environ: Mapping[str, str] | None = None) -> AllocatorSettings | str:
    """The caching allocator's settings the run has (``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``).

    Or why its reserved memory is not simulated: a configuration torch would refuse, or CUDA's own allocator
    (``backend:cudaMallocAsync``), which the model does not follow.

    >>> run_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).conf()
    'expandable_segments:True'
    >>> print(run_settings({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}))
    reserved memory not simulated: backend:cudaMallocAsync is CUDA's own allocator, which the model does not follow
    """
    try:
        settings = AllocatorSettings.from_environment(os.environ if environ is None else environ)
    except ValueError as error:
        return f"reserved memory not simulated: {error}"
    if settings.backend != "native":
        return (
            f"reserved memory not simulated: backend:{settings.backend} is CUDA's own allocator, which the model does"
            " not follow"
        )
    return settings


class ReservedPeaks:
    """A replay's allocation sequence, run through a caching allocator's model: each phase's reserved peak, bytes.

    An allocation listener (``malloc``, ``free``, ``reset_peaks``) and a sampler of the replay (``start_phase`` marks
    where each phase starts: its peaks restart there). The sequence is kept until :meth:`finish`, which runs it as a
    steady step holds it: the library workspaces (negative blocks, allocated at a thread's first matmul and kept for
    the process) are alive from the step's start, allocated after the tensors that exist before it, since every
    earlier step allocated them.
    """

    def __init__(self, settings: AllocatorSettings) -> None:
        self.settings = settings
        self._events: list[AllocationEvent] = []

    def malloc(self, block: int, size: int, stream: int = 0) -> None:
        """``block`` (``size`` bytes as requested) is allocated on ``stream``."""
        self._events.append(("malloc", block, size, stream))

    def free(self, block: int) -> None:
        """``block`` is freed."""
        self._events.append(("free", block, 0, 0))

    def reset_peaks(self) -> None:
        """A phase starts (already marked by :meth:`start_phase`, which the replay calls first)."""

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts: the peaks restart here."""
        self._events.append(phase)

    def sample(self, op: str) -> None:
        """An op ran: nothing to note (its allocations came as ``malloc`` and ``free``)."""

    def sequence(self) -> AllocationSequence:
        """The sequence so far as a steady step makes it: the workspaces moved to the step's start."""
        first = next((index for index, event in enumerate(self._events) if isinstance(event, Phase)), 0)
        before, during = self._events[:first], self._events[first:]
        workspaces = [event for event in during if not isinstance(event, Phase) and event[1] < 0]
        return (*before, *workspaces, *(event for event in during if event not in workspaces))

    def finish(self, settings: AllocatorSettings | None = None) -> dict[Phase, int]:
        """The sequence so far through a fresh model: every phase's reserved peak, bytes.

        ``settings``: the allocator's (default: those given at construction), so that one sequence answers what
        another setting would have reserved.
        """
        model = CachingAllocatorModel(settings or self.settings)
        peaks: dict[Phase, int] = {}
        phase: Phase | None = None
        for event in self.sequence():
            if isinstance(event, Phase):
                if phase is not None:
                    peaks[phase] = max(peaks.get(phase, 0), model.peak_reserved_bytes)
                phase = event
                model.reset_peaks()
            elif event[0] == "malloc":
                model.malloc(event[1], event[2], event[3])
            else:
                model.free(event[1])
        if phase is not None:
            peaks[phase] = max(peaks.get(phase, 0), model.peak_reserved_bytes)
        return peaks
