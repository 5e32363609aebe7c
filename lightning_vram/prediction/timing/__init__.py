"""Step time beside memory: a replayed step's predicted seconds on a device, from its ops' FLOPs and bytes.

``peaks.py``: :class:`DevicePeaks` and :data:`GPU_PEAKS`, the published dense figures of the common GPUs, sources
named; ``host.py``: :func:`measure_host_peaks`, this machine's CPU measured; ``links.py``: NVLink, PCIe and network
bandwidths and :func:`communication_seconds`; ``model.py``: :func:`predict_step_time` (a roofline per op) and
:func:`calibrated` (the run's measured step over its prediction).
"""

from __future__ import annotations

from lightning_vram.prediction.timing.host import measure_host, measure_host_peaks
from lightning_vram.prediction.timing.links import LINKS, Link, communication_seconds
from lightning_vram.prediction.timing.model import calibrated, predict_step_time
from lightning_vram.prediction.timing.peaks import GPU_PEAKS, DevicePeaks, gpu_peaks

__all__ = [
    "GPU_PEAKS",
    "LINKS",
    "DevicePeaks",
    "Link",
    "calibrated",
    "communication_seconds",
    "gpu_peaks",
    "measure_host",
    "measure_host_peaks",
    "predict_step_time",
]
