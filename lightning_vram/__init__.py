"""lightning_vram: where GPU memory goes during training, and what to change.

Public: :class:`VramMonitor` (the Lightning callback), :class:`VramSession` (the same monitor for Fabric and plain
PyTorch loops), :class:`Report`, :class:`VramMonitorWarning`, :class:`Publisher` and
:func:`publisher_for` (where the results go: one publisher per logger), :func:`predict` (a training step's memory
and the largest batch per GPU, predicted without training); ``lightning_vram.testing`` (a scripted probe for tests),
``lightning_vram.pytorch_lightning`` (the callback for the ``pytorch_lightning`` package) and the records in
``lightning_vram.records``. Everything else is internal; a module whose name starts with an underscore is used only
inside its own package.
"""

from lightning_vram.callback import VramMonitor
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.predict import predict
from lightning_vram.records import Report
from lightning_vram.render.publishers import publisher_for
from lightning_vram.render.publishing import Publisher
from lightning_vram.session import VramSession

__version__ = "0.10.0"

__all__ = [
    "Publisher",
    "Report",
    "VramMonitor",
    "VramMonitorWarning",
    "VramSession",
    "__version__",
    "predict",
    "publisher_for",
]
