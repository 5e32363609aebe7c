"""CSVLogger: the scalars in ``metrics.csv``; the report files in its versioned ``log_dir``."""

from __future__ import annotations

from lightning_vram.render.files import Location, as_location
from lightning_vram.render.publishers.logger import LoggerPublisher


class CsvPublisher(LoggerPublisher):
    """A ``CSVLogger``: scalars, and its ``log_dir`` (``<save_dir>/<name>/version_<n>``) for the files."""

    def run_dir(self, root: Location) -> Location | None:
        """The logger's versioned ``log_dir``."""
        return as_location(self.logger.log_dir)
