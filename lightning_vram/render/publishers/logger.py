"""The publisher every Lightning logger gets at least: scalars through its ``log_metrics``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lightning_vram.render.publishing import Publisher


class Logger(Protocol):
    """The part of a Lightning logger every publisher uses."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log ``metrics`` at ``step``."""
        ...


class LoggerPublisher(Publisher):
    """Scalars through ``logger.log_metrics``; nothing else (a logger of a kind the monitor does not know)."""

    def __init__(self, logger: Logger) -> None:
        self.logger: Any = logger
        """The Lightning logger (typed ``Any``: each kind's own methods are called on it)."""
        self.name = type(logger).__name__

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Through ``log_metrics``, at ``step``."""
        self.logger.log_metrics(dict(values), step=step)
