"""Device probes: what the monitor reads from the device, one class per kind of device.

``read_allocator`` runs at the end of every step (and at every phase boundary of the steps read phase by phase), and
``reset_peak`` at the start of the others, so both touch host-side counters only and never synchronise the device.
Utilization and host memory are read once per log interval.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import psutil
import torch

from lightning_vram.exceptions import SESSION, warn
from lightning_vram.measure._nvml import NvmlSampler, NvmlUnavailableError
from lightning_vram.records import AllocatorReading, DeviceInfo, NotMeasured, UtilizationReading

_new_reading: Callable[[type[AllocatorReading], tuple[int, int, int, int, int]], AllocatorReading]
_new_reading = tuple.__new__
"""An :class:`AllocatorReading` from its five fields in order, without the NamedTuple's Python-level ``__new__``."""

ALLOCATOR_NOT_ON_CPU = NotMeasured(
    "allocator peaks and reserved memory",
    "training runs on the CPU, which has no caching allocator: phase peaks are live peaks, every tensor alive"
    " counted on sampled steps (where that count stood aside, the sum of counted tensors)",
)
UTILIZATION_NOT_ON_CPU = NotMeasured("GPU utilization", "training runs on the CPU")


def too_short_for_utilization(interval_seconds: float) -> NotMeasured:
    """GPU utilization not measured: no NVML sample fell inside the run (sampled every ``interval_seconds``)."""
    return NotMeasured("GPU utilization", f"run shorter than the sampling interval of {interval_seconds:g} s")


@runtime_checkable
class Probe(Protocol):
    """Reads one device. Implemented by :class:`CudaProbe`, :class:`CpuProbe` and ``testing.ScriptedProbe``."""

    def open(self, device: torch.device) -> DeviceInfo:
        """Start measuring ``device`` (the LightningModule's device) and describe it."""
        ...

    def read_allocator(self, reset_peak: bool) -> AllocatorReading | None:
        """Allocator counters now; with ``reset_peak`` the peak restarts from the current value.

        ``None`` where the device has no caching allocator. Called on the hot path: no device sync.
        """
        ...

    def reset_peak(self) -> None:
        """Restart the allocator's peak from the current value, reading nothing (a step read once, at its end).

        Called on the hot path: no device sync; a no-op where there is no caching allocator.
        """
        ...

    def take_utilization(self) -> UtilizationReading | None:
        """Utilization averaged since the last call, or ``None`` where it is not measured."""
        ...

    def mean_utilization_percent(self) -> float | None:
        """Utilization averaged over the whole run, in percent, or ``None``."""
        ...

    def host_rss_bytes(self) -> int | None:
        """Resident memory of this process on the host, in bytes."""
        ...

    def free_bytes(self) -> int | None:
        """Device memory free now outside this process's allocator, in bytes (``None`` where not known).

        Read once, before the first step (preflight); it may cost a driver call, never a synchronisation.
        """
        ...

    def unavailable(self) -> tuple[NotMeasured, ...]:
        """What this probe could not measure, and why."""
        ...

    def close(self) -> None:
        """Stop background work. Safe to call twice."""
        ...


_PROCESS: dict[int, psutil.Process] = {}
"""This process as psutil reads it, by pid (a forked child reads its own): built once, read every log interval."""


def _host_rss_bytes() -> int:
    pid = os.getpid()
    process = _PROCESS.get(pid)
    if process is None:
        _PROCESS.clear()
        process = _PROCESS[pid] = psutil.Process(pid)
    return int(process.memory_info().rss)


class CpuProbe:
    """Training on the CPU: no allocator counters and no utilization, only host memory."""

    def open(self, device: torch.device) -> DeviceInfo:
        """Describe the host as the device; capacity is the machine's physical memory."""
        name = platform.processor() or platform.machine() or "cpu"
        return DeviceInfo(type=device.type, name=name, index=None, total_bytes=int(psutil.virtual_memory().total))

    def read_allocator(self, reset_peak: bool) -> AllocatorReading | None:
        """The CPU has no caching allocator: always ``None``."""
        return None

    def reset_peak(self) -> None:
        """The CPU has no caching allocator: nothing to reset."""

    def take_utilization(self) -> UtilizationReading | None:
        """Not measured on the CPU."""
        return None

    def mean_utilization_percent(self) -> float | None:
        """Not measured on the CPU."""
        return None

    def host_rss_bytes(self) -> int | None:
        """Resident memory of this process, in bytes."""
        return _host_rss_bytes()

    def free_bytes(self) -> int | None:
        """Not used on the CPU (no preflight there): ``None``."""
        return None

    def unavailable(self) -> tuple[NotMeasured, ...]:
        """Allocator peaks and GPU utilization."""
        return (ALLOCATOR_NOT_ON_CPU, UTILIZATION_NOT_ON_CPU)

    def close(self) -> None:
        """Nothing to stop."""


class BlindProbe(CpuProbe):
    """Reads nothing: stands in for a probe that failed to open, so that the run and its report go on.

    The guard warned and lists the failed probe in the report; this one adds nothing to ``not_measured``.
    """

    def open(self, device: torch.device) -> DeviceInfo:
        """The device as torch names it; its model and capacity are not known."""
        return DeviceInfo(type=device.type, name=str(device), index=device.index, total_bytes=None)

    def host_rss_bytes(self) -> int | None:
        """Not read: ``None``."""
        return None

    def unavailable(self) -> tuple[NotMeasured, ...]:
        """Nothing beyond the failed probe the guard reports."""
        return ()


class NvmlUtilization:
    """GPU utilization and this process's device memory, sampled by NVML on a background thread.

    Whatever NVML's bindings raise, at start or later on the sampling thread, becomes one warning and one
    ``not_measured`` entry; the memory readings of the allocator go on. ``owner`` begins the warning.
    """

    def __init__(self, interval_seconds: float, owner: str = SESSION) -> None:
        self._interval_seconds = interval_seconds
        self._owner = owner
        self._sampler: NvmlSampler | None = None
        self._unavailable: list[NotMeasured] = []
        self._sampler_error_reported = False

    def start(self, device_uuid: str) -> None:
        """Start sampling the GPU with this UUID; when NVML cannot be used, warn once and note why."""
        sampler = NvmlSampler(device_uuid, self._interval_seconds)
        try:
            sampler.start()
        except NvmlUnavailableError as error:
            self._unavailable.append(NotMeasured("GPU utilization and process memory (NVML)", str(error)))
            warn(f"{self._owner}: {error}. GPU utilization is not measured; memory is.")
        else:
            self._sampler = sampler

    def _note_sampler_error(self) -> None:
        sampler = self._sampler
        if sampler is None or sampler.error is None or self._sampler_error_reported:
            return
        self._sampler_error_reported = True
        self._unavailable.append(NotMeasured("GPU utilization after the error", sampler.error))
        message = f"{self._owner}: {sampler.error}; utilization sampling stopped."
        warn(message)

    def take(self) -> UtilizationReading | None:
        """Utilization averaged since the last call (``None`` without NVML)."""
        self._note_sampler_error()
        return self._sampler.take() if self._sampler is not None else None

    def run_mean_percent(self) -> float | None:
        """Utilization averaged over the run, in percent (``None`` without NVML or without a sample)."""
        self._note_sampler_error()
        return self._sampler.run_mean_percent() if self._sampler is not None else None

    def unavailable(self) -> tuple[NotMeasured, ...]:
        """Why NVML could not be used, stopped sampling, or has no sample of the run (shorter than the interval)."""
        self._note_sampler_error()
        sampler = self._sampler
        if sampler is not None and sampler.error is None and sampler.run_mean_percent() is None:
            return (*self._unavailable, too_short_for_utilization(self._interval_seconds))
        return tuple(self._unavailable)

    def stop(self) -> None:
        """Stop the sampling thread and release NVML. Safe to call twice."""
        if self._sampler is not None:
            self._sampler.stop()


class CudaProbe:
    """A CUDA device: the caching allocator's counters, and NVML on a background timer."""

    def __init__(self, utilization_interval_seconds: float, owner: str = SESSION) -> None:
        self._index = 0
        self._nvml = NvmlUtilization(utilization_interval_seconds, owner)

    def open(self, device: torch.device) -> DeviceInfo:
        """Describe the device and start NVML; a failing NVML warns once and is reported as not measured."""
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(self._index)
        self._nvml.start(str(properties.uuid))
        return DeviceInfo(
            type="cuda",
            name=properties.name,
            index=self._index,
            total_bytes=int(properties.total_memory),
            compute_capability=(int(properties.major), int(properties.minor)),
        )

    def read_allocator(self, reset_peak: bool) -> AllocatorReading | None:
        """One host-side read of the allocator's statistics (no device synchronisation).

        ``memory_stats_as_nested_dict`` is torch's cheapest public call that gives the peak and the current values
        together (``torch._C._cuda_memoryStats``, about 18 us on an H200); ``memory_allocated`` and
        ``max_memory_allocated`` each build that dictionary and flatten it (about 80-100 us).
        """
        stats = torch.cuda.memory_stats_as_nested_dict(self._index)
        allocated = stats["allocated_bytes"]["all"]
        reading = _new_reading(
            AllocatorReading,
            (
                int(allocated["current"]),
                int(stats["reserved_bytes"]["all"]["current"]),
                int(allocated["peak"]),
                int(stats["num_alloc_retries"]),
                int(stats["num_ooms"]),
            ),
        )
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(self._index)
        return reading

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``: host-side, about 0.2 us."""
        torch.cuda.reset_peak_memory_stats(self._index)

    def take_utilization(self) -> UtilizationReading | None:
        """NVML's utilization averaged since the last call."""
        return self._nvml.take()

    def mean_utilization_percent(self) -> float | None:
        """NVML's utilization averaged over the run."""
        return self._nvml.run_mean_percent()

    def host_rss_bytes(self) -> int | None:
        """Resident memory of this process on the host, in bytes."""
        return _host_rss_bytes()

    def free_bytes(self) -> int | None:
        """Free device memory as the driver reports it (``cudaMemGetInfo``: no synchronisation)."""
        free, _total = torch.cuda.mem_get_info(self._index)
        return int(free)

    def unavailable(self) -> tuple[NotMeasured, ...]:
        """NVML, when it could not be used or stopped sampling."""
        return self._nvml.unavailable()

    def close(self) -> None:
        """Stop the NVML thread."""
        self._nvml.stop()


def probe_for(device: torch.device, utilization_interval_seconds: float, owner: str = SESSION) -> Probe:
    """The probe that fits the device the LightningModule lives on; ``owner`` begins its warnings."""
    if device.type == "cuda":
        return CudaProbe(utilization_interval_seconds, owner)
    return CpuProbe()
