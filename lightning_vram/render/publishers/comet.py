"""Comet (``CometLogger``): figures as images, advice as text, the files as assets, tags, the peak as an "other"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lightning_vram.render.files import Location, as_location, join
from lightning_vram.render.publishers.logger import LoggerPublisher


class CometPublisher(LoggerPublisher):
    """A ``CometLogger``: everything through its experiment (``logger.experiment``)."""

    def run_dir(self, root: Location) -> Location | None:
        """``<save_dir or root>/vram_<experiment key>``: a folder of this experiment alone."""
        save_dir = self.logger.save_dir
        return join(as_location(save_dir) if save_dir else root, f"vram_{self.logger.experiment.get_key()}")

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        """``log_image`` under ``name`` (as a PIL image: Comet tries a NumPy array as a path first)."""
        from PIL import Image  # matplotlib's own dependency

        self.logger.experiment.log_image(Image.fromarray(pixels), name=name, step=step)

    def text(self, name: str, markdown: str, step: int) -> None:
        """``log_text`` with ``name`` in its metadata."""
        self.logger.experiment.log_text(markdown, step=step, metadata={"name": name})

    def artifacts(self, paths: Sequence[Path]) -> None:
        """``log_asset`` each."""
        for path in paths:
            self.logger.experiment.log_asset(str(path), file_name=path.name)

    def tags(self, ids: Sequence[str]) -> None:
        """``add_tags``."""
        self.logger.experiment.add_tags(list(ids))

    def summary(self, values: Mapping[str, float]) -> None:
        """``log_other`` each (Comet's run-level values)."""
        for name, value in values.items():
            self.logger.experiment.log_other(name, value)
