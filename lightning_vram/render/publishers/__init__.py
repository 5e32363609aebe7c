"""One publisher per kind of logger, chosen by the logger's class name.

An optional package (``wandb``, ``mlflow``, ``comet_ml``) is imported only by the publisher of a logger in use.
:func:`publisher_for` serves ``lightning``'s and ``pytorch_lightning``'s loggers alike (it reads class names, so it
imports neither): TensorBoard, CSV, W&B, MLflow and Comet get everything they hold; any other logger gets the scalars
through its ``log_metrics`` and one :class:`~lightning_vram.VramMonitorWarning`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_vram.exceptions import warn
from lightning_vram.render.files import Location
from lightning_vram.render.publishers.comet import CometPublisher
from lightning_vram.render.publishers.csv import CsvPublisher
from lightning_vram.render.publishers.logger import Logger, LoggerPublisher
from lightning_vram.render.publishers.mlflow import MlflowPublisher
from lightning_vram.render.publishers.tensorboard import TensorBoardPublisher
from lightning_vram.render.publishers.wandb import WandbPublisher
from lightning_vram.render.publishing import Publisher

_BY_CLASS: dict[str, type[LoggerPublisher]] = {
    "TensorBoardLogger": TensorBoardPublisher,
    "CSVLogger": CsvPublisher,
    "WandbLogger": WandbPublisher,
    "MLFlowLogger": MlflowPublisher,
    "CometLogger": CometPublisher,
    "DummyLogger": LoggerPublisher,  # fast_dev_run's stand-in: it keeps nothing, and needs no warning
}


def publisher_for(logger: Logger) -> Publisher:
    """The publisher of a Lightning logger; one of an unknown kind gets the scalars only, and a warning."""
    for cls in type(logger).__mro__:
        kind = _BY_CLASS.get(cls.__name__)
        if kind is not None:
            return kind(logger)
    warn(
        f"VramMonitor: {type(logger).__name__} gets the vram/... scalars only (its figures, advice and report files"
        " go to the other loggers and the log folder); a lightning_vram.Publisher can serve it."
    )
    return LoggerPublisher(logger)


def run_dir_of(publishers: Sequence[Publisher], root: Location) -> Location:
    """Where the report files go: the first publisher's own run folder, else ``root``."""
    for publisher in publishers:
        directory = publisher.run_dir(root)
        if directory is not None:
            return directory
    return root
