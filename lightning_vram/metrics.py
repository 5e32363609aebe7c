"""Scalar names and values logged once per interval. Every name carries its unit."""

from __future__ import annotations

from lightning_vram.records import UtilizationReading
from lightning_vram.timing import IntervalTiming
from lightning_vram.tracker import IntervalMemory

PREFIX = "vram/"


def interval_scalars(
    memory: IntervalMemory,
    timing: IntervalTiming,
    utilization: UtilizationReading | None,
    host_rss_bytes: int | None,
) -> dict[str, float]:
    """The scalars of one log interval; what was not measured is left out, never logged as zero."""
    values: dict[str, float | int | None] = {
        "allocated_bytes": memory.allocated_bytes,
        "reserved_bytes": memory.reserved_bytes,
        "step_seconds": timing.step_seconds,
        "data_wait_fraction": timing.data_wait_fraction,
        "host_rss_bytes": host_rss_bytes,
    }
    if memory.peak is not None:
        values["peak_bytes"] = memory.peak.peak_bytes
        if memory.peak.breakdown is not None:
            for category, nbytes in memory.peak.breakdown.to_dict().items():
                values[f"peak/{category}_bytes"] = nbytes
    for phase, nbytes in memory.phase_peak_bytes.items():
        values[f"phase_peak/{phase.value}_bytes"] = nbytes
    if utilization is not None:
        values["gpu_utilization_percent"] = utilization.gpu_utilization_percent
        values["process_memory_bytes"] = utilization.process_memory_bytes
    return {PREFIX + name: float(value) for name, value in values.items() if value is not None}
