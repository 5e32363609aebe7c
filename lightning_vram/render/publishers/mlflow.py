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
        """The run's own artifact folder where the artifact store is local; else ``<root>/mlflow_<run id>``.

        Files written there are the run's artifacts already; a folder in the tracking store's root would read as a
        malformed experiment to MLflow's file store.
        """
        local = self._artifact_dir()
        return local if local is not None else join(root, f"mlflow_{self.logger.run_id}")

    def _artifact_dir(self) -> Path | None:
        location = as_location(self.logger.experiment.get_run(self.logger.run_id).info.artifact_uri)
        return location if isinstance(location, Path) else None

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        """``log_image`` to the artifact ``<name>.png`` (``vram/figures/breakdown.png``)."""
        self.logger.experiment.log_image(self.logger.run_id, pixels, artifact_file=f"{name}.png")

    def text(self, name: str, markdown: str, step: int) -> None:
        """``log_text`` to the artifact ``<name>.md`` (``vram/advice.md``), the latest advice."""
        self.logger.experiment.log_text(self.logger.run_id, markdown, f"{name}.md")

    def artifacts(self, paths: Sequence[Path]) -> None:
        """``log_artifact`` each, at the run's artifact root, but those written there already."""
        local = self._artifact_dir()
        for path in paths:
            if local is None or path.parent.resolve() != local.resolve():
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
            exact = str(int(value)) if float(value).is_integer() else repr(float(value))  # no rounding of bytes
            self.logger.experiment.set_tag(self.logger.run_id, name.replace("/", "."), exact)
