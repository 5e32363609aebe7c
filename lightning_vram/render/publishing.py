"""The publisher protocol: where a run's scalars, figures, advice, report files, tags and summary go.

One :class:`Publisher` stands for one destination (a Lightning logger, a writer, a tracking client). Every method
does nothing by default: a destination overrides what it can hold. Steps are the destination's own step counter
(Lightning's ``_batches_that_stepped`` under the callback); values carry their unit in their name
(``vram/peak_mib``: mebibytes, 2**20 bytes; ``vram/peak_bytes``: bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lightning_vram.render.files import Location


class Publisher:
    """One destination of a run's results; subclass it and override what the destination holds.

    Every call runs inside the monitor's guard: an error warns once and switches this publisher off for the rest of
    the run (training goes on; the report lists it under ``not_measured``).
    """

    name = "publisher"
    """How warnings and the report's ``not_measured`` name this publisher."""

    def run_dir(self, root: Location) -> Location | None:
        """A folder of this run alone for the report files (``root``: the Trainer's ``default_root_dir``).

        ``None``: the destination has none (the files go to the next publisher's folder, else ``root``).
        """
        return None

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """The ``vram/...`` scalars of one log interval, at ``step``."""

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        """A figure as ``(height, width, 3)`` uint8 RGB pixels, under ``name`` (``vram/figures/...``), at ``step``."""

    def text(self, name: str, markdown: str, step: int) -> None:
        """Markdown text (the advice) under ``name``, at ``step``."""

    def artifacts(self, paths: Sequence[Path]) -> None:
        """The report files (``vram_report.json``, ``.md``, ``.html``, local), to keep with this run."""

    def tags(self, ids: Sequence[str]) -> None:
        """The advice ids of the report, as tags of the run."""

    def summary(self, values: Mapping[str, float]) -> None:
        """The run's headline numbers (``vram/peak_mib``, ``vram/peak_bytes``), once at the end."""
