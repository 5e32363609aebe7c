"""lightning_vram: where GPU memory goes during Lightning training, and what to change."""

from lightning_vram.callback import VramMonitor
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.report import Report

__version__ = "0.6.0"

__all__ = ["Report", "VramMonitor", "VramMonitorWarning", "__version__"]
