"""lightning_vram: where GPU memory goes during training, and what to change.

Public: :class:`VramMonitor` (the Lightning callback), :class:`VramSession` (the same monitor for Fabric and plain
PyTorch loops), :class:`Report`, :class:`VramMonitorWarning`, :class:`Publisher` and
:func:`publisher_for` (where the results go: one publisher per logger), :func:`predict` (a training step's memory
and the largest batch per GPU, predicted without training), :func:`plan` (which GPUs, how many, which strategy and
settings, and how fast a step runs, predicted without training); ``lightning_vram.testing`` (a scripted probe for
tests), ``lightning_vram.pytorch_lightning`` (the callback for the ``pytorch_lightning`` package) and the records in
``lightning_vram.records``. Everything else is internal; a module whose name starts with an underscore is used only
inside its own package.

The exports are imported on first use (PEP 562), so that ``import lightning_vram.codec`` or the ``lightning-vram``
command reads reports without importing torch and Lightning.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from lightning_vram._version import __version__

if TYPE_CHECKING:
    from lightning_vram.callback import VramMonitor
    from lightning_vram.exceptions import VramMonitorWarning
    from lightning_vram.plan import plan
    from lightning_vram.predict import predict
    from lightning_vram.records import Report
    from lightning_vram.render.publishers import publisher_for
    from lightning_vram.render.publishing import Publisher
    from lightning_vram.session import VramSession

__all__ = [
    "Publisher",
    "Report",
    "VramMonitor",
    "VramMonitorWarning",
    "VramSession",
    "__version__",
    "plan",
    "predict",
    "publisher_for",
]

_EXPORTS = {
    "Publisher": "lightning_vram.render.publishing",
    "Report": "lightning_vram.records",
    "VramMonitor": "lightning_vram.callback",
    "VramMonitorWarning": "lightning_vram.exceptions",
    "VramSession": "lightning_vram.session",
    "plan": "lightning_vram.plan",
    "predict": "lightning_vram.predict",
    "publisher_for": "lightning_vram.render.publishers",
}
"""Each lazy export and the module it comes from."""


def __getattr__(name: str) -> Any:
    """The export ``name``, imported from its module on first use and kept in this module's namespace."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy exports included."""
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module: a submodule named like an export (``lightning_vram.plan``) leaves the export in place.

    The import system names each submodule on its package once it is loaded; ``import lightning_vram.predict``
    would otherwise make ``lightning_vram.predict`` the module rather than the function.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
