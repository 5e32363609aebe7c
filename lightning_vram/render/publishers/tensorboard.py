"""TensorBoard: scalars with a Custom Scalars layout of the charts logged, figures as images, advice as text."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lightning_vram.render.files import Location, as_location
from lightning_vram.render.publishers.logger import Logger, LoggerPublisher
from lightning_vram.render.tensorboard import OwnWriter, TensorBoardWriter, layout_for, write_layout


class TensorBoardPublisher(LoggerPublisher):
    """A ``TensorBoardLogger`` (its ``experiment`` is the writer), or a bare writer whose scalars the caller logs.

    The layout lists only the charts of scalars logged so far: it is written again when a scalar needs a new chart
    (a few times a run at most).
    """

    def __init__(self, logger: Logger | None = None, writer: TensorBoardWriter | None = None) -> None:
        if logger is not None:
            super().__init__(logger)
        self.name = "TensorBoard"
        self._logs_scalars = logger is not None
        self.writer: TensorBoardWriter = writer if writer is not None else self.logger.experiment
        self._logged: set[str] = set()
        self._layout: dict[str, dict[str, list[object]]] = {}
        self._own = OwnWriter(self.writer)

    def run_dir(self, root: Location) -> Location | None:
        """The logger's versioned ``log_dir`` (``trainer.log_dir``); a bare writer's own directory."""
        return as_location(self.logger.log_dir if self._logs_scalars else self.writer.get_logdir())

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Through the logger (a bare writer's caller logs them); the layout grows with the charts they need."""
        if self._logs_scalars:
            super().scalars(values, step)
        if values.keys() <= self._logged:
            return
        self._logged |= values.keys()
        layout = layout_for(self._logged)
        if layout != self._layout:
            write_layout(self._own, layout)
            self._layout = layout

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        """``add_image`` (HWC), in the monitor's own run (:data:`~lightning_vram.render.tensorboard.MONITOR_RUN`)."""
        writer = self._own.get()
        writer.add_image(name, pixels, global_step=step, dataformats="HWC")
        writer.flush()

    def text(self, name: str, markdown: str, step: int) -> None:
        """``add_text`` (TensorBoard's text tab renders Markdown), in the monitor's own run."""
        writer = self._own.get()
        writer.add_text(name, markdown, global_step=step)
        writer.flush()
