"""MLflow (``MLFlowLogger``): figures and advice as artifacts of the run, the files as artifacts, tags.

Everything goes through the logger's ``MlflowClient`` with the logger's ``run_id``. MLflow has no run summary: the
peak is a tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lightning_vram.render.files import Location, as_location, join
from lightning_vram.render.publishers.logger import LoggerPublisher


class MlflowPublisher(LoggerPublisher):
    """An ``MLFlowLogger``: artifacts, tags and the peak as a tag, on the logger's run."""

    def run_dir(self, root: Location) -> Location | None:
        """``<save_dir>/<run_id>`` (``root`` in place of a remote tracking server's ``save_dir``)."""
        save_dir = self.logger.save_dir
        return join(as_location(save_dir) if save_dir else root, self.logger.run_id)

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        """``log_image`` to the artifact ``<name>.png`` (``vram/figures/breakdown.png``)."""
        self.logger.experiment.log_image(self.logger.run_id, pixels, artifact_file=f"{name}.png")

    def text(self, name: str, markdown: str, step: int) -> None:
        """``log_text`` to the artifact ``<name>.md`` (``vram/advice.md``), the latest advice."""
        self.logger.experiment.log_text(self.logger.run_id, markdown, f"{name}.md")

    def artifacts(self, paths: Sequence[Path]) -> None:
        """``log_artifact`` each, at the run's artifact root."""
        for path in paths:
            self.logger.experiment.log_artifact(self.logger.run_id, str(path))

    def tags(self, ids: Sequence[str]) -> None:
        """``vram.advice``: the ids, comma-separated; ``vram.advice.<id>``: ``true`` for each."""
        client, run_id = self.logger.experiment, self.logger.run_id
        client.set_tag(run_id, "vram.advice", ",".join(ids))
        for advice_id in ids:
            client.set_tag(run_id, f"vram.advice.{advice_id}", "true")

    def summary(self, values: Mapping[str, float]) -> None:
        """Each value as a tag (``vram/peak_mib`` -> ``vram.peak_mib``)."""
        for name, value in values.items():
            self.logger.experiment.set_tag(self.logger.run_id, name.replace("/", "."), f"{value:g}")
