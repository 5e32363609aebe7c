"""Weights & Biases (``WandbLogger``): figures as images, advice as HTML, the files in the run, tags and summary.

Steps follow ``WandbLogger``: each call logs ``trainer/global_step`` (the x axis Lightning defines) with its values.
``wandb`` is imported only here, when a ``WandbLogger`` is in use.
"""

from __future__ import annotations

import html
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lightning_vram.render.files import Location
from lightning_vram.render.publishers.logger import LoggerPublisher


class WandbPublisher(LoggerPublisher):
    """A ``WandbLogger``: its run (``logger.experiment``) holds everything; the files go into the run's own folder."""

    def run_dir(self, root: Location) -> Location | None:
        """The run's files folder (``wandb/run-<time>-<id>/files``), which no other run shares."""
        return Path(self.logger.experiment.dir)

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        """``WandbLogger.log_image`` (a ``wandb.Image``)."""
        self.logger.log_image(key=name, images=[pixels], step=step)

    def text(self, name: str, markdown: str, step: int) -> None:
        """A ``wandb.Html`` panel with the Markdown as preformatted text."""
        import wandb

        self.logger.log_metrics({name: wandb.Html(f"<pre>{html.escape(markdown)}</pre>")}, step=step)

    def artifacts(self, paths: Sequence[Path]) -> None:
        """Copied into the run's files folder where they are not there yet, and saved with the run now."""
        run = self.logger.experiment
        directory = Path(run.dir)
        for path in paths:
            target = directory / path.name
            if path.resolve() != target.resolve():
                shutil.copyfile(path, target)
            run.save(str(target), base_path=str(directory), policy="now")

    def tags(self, ids: Sequence[str]) -> None:
        """Added to the run's tags."""
        run = self.logger.experiment
        run.tags = (*(run.tags or ()), *(tag for tag in ids if tag not in (run.tags or ())))

    def summary(self, values: Mapping[str, float]) -> None:
        """Into the run's summary."""
        self.logger.experiment.summary.update(dict(values))
