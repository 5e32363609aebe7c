"""Scalar names and values logged once per interval. Every name carries its unit."""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_vram.records import IntervalMemory, IntervalTiming, UtilizationReading

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


SCALAR_NAMES = (
    "allocated_bytes",
    "reserved_bytes",
    "step_seconds",
    "data_wait_fraction",
    "host_rss_bytes",
    "peak_bytes",
    "peak/parameters_bytes",
    "peak/gradients_bytes",
    "peak/optimizer_state_bytes",
    "peak/activations_bytes",
    "peak/other_bytes",
    "phase_peak/forward_bytes",
    "phase_peak/backward_bytes",
    "phase_peak/optimizer_bytes",
    "gpu_utilization_percent",
    "process_memory_bytes",
)
"""Every scalar the monitor logs, without the prefix, in the fixed order ranks exchange them in."""
PER_RANK_NAMES = ("allocated_bytes", "reserved_bytes", "peak_bytes", "gpu_utilization_percent", "data_wait_fraction")
"""Scalars also logged for each rank, as ``vram/rank_<N>/<name>``."""


def scalar_vector(scalars: dict[str, float]) -> list[float]:
    """One rank's scalars in :data:`SCALAR_NAMES` order, NaN where not measured."""
    return [scalars.get(PREFIX + name, math.nan) for name in SCALAR_NAMES]


def reduce_over_ranks(rows: list[list[float]]) -> dict[str, float]:
    """The scalars rank zero logs from every rank's :func:`scalar_vector`.

    Each scalar is the maximum over the ranks that measured it (the worst rank sets the chart); the breakdown at the
    peak is the one of the rank with the highest peak, so its parts still add up; :data:`PER_RANK_NAMES` are also
    logged per rank.

    >>> nan = math.nan
    >>> rows = [[nan] * 5 + [10.0] + [1.0] * 5 + [nan] * 5, [nan] * 5 + [30.0] + [2.0] * 5 + [nan] * 5]
    >>> reduced = reduce_over_ranks(rows)
    >>> reduced["vram/peak_bytes"], reduced["vram/peak/parameters_bytes"], reduced["vram/rank_0/peak_bytes"]
    (30.0, 2.0, 10.0)
    """
    scalars: dict[str, float] = {}
    peak_index = SCALAR_NAMES.index("peak_bytes")
    peaks = [row[peak_index] for row in rows]
    highest = max(range(len(rows)), key=lambda rank: -math.inf if math.isnan(peaks[rank]) else peaks[rank])
    for index, name in enumerate(SCALAR_NAMES):
        values = [row[index] for row in rows if not math.isnan(row[index])]
        if name.startswith("peak/"):
            value = rows[highest][index]
            if not math.isnan(value):
                scalars[PREFIX + name] = value
        elif values:
            scalars[PREFIX + name] = max(values)
        if name in PER_RANK_NAMES:
            for rank, row in enumerate(rows):
                if not math.isnan(row[index]):
                    scalars[f"{PREFIX}rank_{rank}/{name}"] = row[index]
    return scalars


MIB = 2**20
"""Bytes in a mebibyte."""


def chart_scalars(scalars: Mapping[str, float]) -> dict[str, float]:
    """``scalars`` with a ``..._mib`` twin (mebibytes) of every ``..._bytes`` value, for charts that read well.

    The ``_bytes`` names stay for one release, then only the ``_mib`` ones are logged.

    >>> chart_scalars({"vram/peak_bytes": 3 * MIB, "vram/step_seconds": 0.5})
    {'vram/peak_bytes': 3145728, 'vram/step_seconds': 0.5, 'vram/peak_mib': 3.0}
    """
    twins = {name[: -len("_bytes")] + "_mib": value / MIB for name, value in scalars.items() if name.endswith("_bytes")}
    return {**scalars, **twins}
