"""The reserved memory of a replayed step: a model of the CUDA caching allocator driven by the replay, per phase.

:class:`ReservedPeaks` takes the replay's allocation sequence (an
:class:`~lightning_vram.prediction.replay.live.AllocationListener`, cuBLAS's workspaces included) into a
:class:`~lightning_vram.prediction.allocator.model.CachingAllocatorModel` and, as a sampler of the replay's
:class:`~lightning_vram.prediction.replay.live.LiveMemory`, reads the model's reserved peak as each phase ends, before
the phase boundary resets the peaks (as the monitor reads torch's counters on a sampled step).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.records import Phase


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
    """A caching allocator's model driven by one replay, and its reserved peak (bytes) in each phase.

    An allocation listener (``malloc``, ``free``, ``reset_peaks``, passed to the model) and a sampler of the replay
    (``start_phase``: the phase before it ends, its peak is read).
    """

    def __init__(self, model: CachingAllocatorModel) -> None:
        self.model = model
        self.peaks: dict[Phase, int] = {}
        """The model's reserved peak in each phase ended, bytes."""
        self._phase: Phase | None = None

    def malloc(self, block: int, size: int, stream: int = 0) -> None:
        """The model allocates ``block`` (``size`` bytes as requested) on ``stream``."""
        self.model.malloc(block, size, stream)

    def free(self, block: int) -> None:
        """The model frees ``block``."""
        self.model.free(block)

    def reset_peaks(self) -> None:
        """A phase starts: the model's peaks restart from what it holds now."""
        self.model.reset_peaks()

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts: the phase before it ends, its reserved peak read before the peaks are reset."""
        self._close()
        self._phase = phase

    def sample(self, op: str) -> None:
        """An op ran: nothing to read (the model keeps its own peak)."""

    def finish(self) -> dict[Phase, int]:
        """The last phase ended: every phase's reserved peak, bytes."""
        self._close()
        self._phase = None
        return self.peaks

    def _close(self) -> None:
        phase = self._phase
        if phase is not None:
            self.peaks[phase] = max(self.peaks.get(phase, 0), self.model.peak_reserved_bytes)
