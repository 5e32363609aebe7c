"""A public scripted probe: drive the monitor's CUDA code path on any machine, in your tests and ours.

The probe plays back allocator values the way the CUDA caching allocator would report them, including
the peak-reset semantics of ``torch.cuda.reset_peak_memory_stats``. Tensor counting stays real.

>>> probe = ScriptedProbe([ScriptedBoundary(allocated_bytes=100, reserved_bytes=256, highest_bytes=100),
...                        ScriptedBoundary(allocated_bytes=120, reserved_bytes=256, highest_bytes=180)])
>>> probe.read_allocator(reset_peak=True).peak_allocated_bytes
100
>>> probe.read_allocator(reset_peak=True).peak_allocated_bytes
180
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_vram.records import AllocatorReading, DeviceInfo, NotMeasured, UtilizationReading

_new_reading: Callable[[type[AllocatorReading], tuple[int, int, int, int, int]], AllocatorReading]
_new_reading = tuple.__new__
"""An :class:`AllocatorReading` from its five fields in order, without the NamedTuple's Python-level ``__new__``."""

SCRIPTED_DEVICE = DeviceInfo(
    type="cuda", name="Scripted GPU", index=0, total_bytes=16 * 1024**3, compute_capability=(8, 0)
)


@dataclass(frozen=True)
class ScriptedBoundary:
    """The allocator at one phase boundary: ``highest_bytes`` is the most allocated since the previous boundary."""

    allocated_bytes: int
    reserved_bytes: int
    highest_bytes: int
    alloc_retries: int = 0
    ooms: int = 0


class ScriptedProbe:
    """Plays back one :class:`ScriptedBoundary` per allocator read, then repeats the last one.

    :attr:`reads` counts the allocator reads and :attr:`resets` the peak resets (with a read or alone), so that a test
    pins what the monitor asks of the allocator on each kind of step.

    Args:
        boundaries: the allocator at each successive read. A step read phase by phase (the run's first
            ``recorder.PHASE_READ_STEPS``, the sampled ones, the last of each log interval, the one after a new run
            peak) reads four times: batch start, before backward, before the optimizer step, batch end (under manual
            optimization under the callback: before and after each backward, before and after each update); any other
            step reads once, at its end, its peak reset at its start (:meth:`reset_peak`), so its boundary's
            ``highest_bytes`` is the step's peak.
        device: what ``open`` reports.
        utilization: one reading per log interval, then the last one again; ``None`` for "not measured".
        not_measured: what the probe reports as unavailable (for example a failing NVML).
        free_bytes: what :meth:`free_bytes` reports (the preflight check reads it once); by default the device's
            capacity less the last boundary's reserve.
    """

    def __init__(
        self,
        boundaries: Sequence[ScriptedBoundary],
        device: DeviceInfo = SCRIPTED_DEVICE,
        utilization: Sequence[UtilizationReading | None] = (),
        not_measured: Sequence[NotMeasured] = (),
        free_bytes: int | None = None,
    ) -> None:
        kept = tuple(boundaries)
        if not kept:
            raise ValueError("boundaries must hold at least one ScriptedBoundary, got an empty sequence")
        self._boundaries = kept
        # Per boundary, what a read needs: (allocated, reserved, highest seen at it, retries, OOMs). Built from the
        # arguments (a subclass may read its own attributes lazily, before __init__ has set them all).
        plays = tuple(
            (b.allocated_bytes, b.reserved_bytes, max(b.highest_bytes, b.allocated_bytes), b.alloc_retries, b.ooms)
            for b in kept
        )
        self._plays, self._last, self._count = plays, plays[-1], len(plays)
        self._device = device
        self._utilization = tuple(utilization)
        self._not_measured = tuple(not_measured)
        self._free_bytes = free_bytes
        self._reserved = 0
        self._allocated = 0
        self._peak = 0
        self.reads = 0
        """Allocator reads so far."""
        self.resets = 0
        """Peak resets so far: with a read (``reset_peak=True``) or alone (:meth:`reset_peak`)."""
        self.utilization_reads = 0
        self.opened_with: torch.device | None = None
        self.closed = False

    def open(self, device: torch.device) -> DeviceInfo:
        """Record the device the monitor asked for and describe the scripted one."""
        self.opened_with = device
        return self._device

    def read_allocator(self, reset_peak: bool) -> AllocatorReading | None:
        """The next scripted boundary, with the peak an allocator would report."""
        plays, reads = self._plays, self.reads
        allocated, reserved, highest, retries, ooms = plays[reads] if reads < self._count else self._last
        self.reads = reads + 1
        self._reserved, self._allocated = reserved, allocated
        peak = self._peak
        if highest > peak:
            peak = highest
        reading = _new_reading(AllocatorReading, (allocated, reserved, peak, retries, ooms))
        if reset_peak:
            self.resets += 1
            peak = allocated
        self._peak = peak
        return reading

    def reset_peak(self) -> None:
        """Restart the peak from the last read's allocated bytes, as ``torch.cuda.reset_peak_memory_stats`` does."""
        self.resets += 1
        self._peak = self._allocated

    def take_utilization(self) -> UtilizationReading | None:
        """The next scripted utilization reading."""
        if not self._utilization:
            return None
        reading = self._utilization[min(self.utilization_reads, len(self._utilization) - 1)]
        self.utilization_reads += 1
        return reading

    def mean_utilization_percent(self) -> float | None:
        """Mean of the scripted utilization readings handed out so far."""
        handed = [
            reading.gpu_utilization_percent
            for reading in self._utilization[: self.utilization_reads]
            if reading is not None and reading.gpu_utilization_percent is not None
        ]
        return sum(handed) / len(handed) if handed else None

    def host_rss_bytes(self) -> int | None:
        """Not scripted: ``None``."""
        return None

    def free_bytes(self) -> int | None:
        """The scripted ``free_bytes``, else the device's capacity less what the last boundary reserved."""
        if self._free_bytes is not None:
            return self._free_bytes
        total = self._device.total_bytes
        return None if total is None else max(total - self._reserved, 0)

    def unavailable(self) -> tuple[NotMeasured, ...]:
        """The scripted ``not_measured`` entries."""
        return self._not_measured

    def close(self) -> None:
        """Record that the monitor closed the probe."""
        self.closed = True
