"""TensorBoard's custom-scalars layout (the charts of the scalars logged), and the report's figures and tags.

Used by the TensorBoard publisher; works with any writer that has these methods of
``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any, Protocol, cast

import numpy as np

from lightning_vram.render.figure_set import FIGURE_TAGS as FIGURE_TAGS  # the tags, where TensorBoard's users look
from lightning_vram.render.figure_set import STEP_MEMORY_TAG as STEP_MEMORY_TAG
from lightning_vram.render.figure_set import FigurePngs, png_pixels

ADVICE_TAG = "vram/advice"

LAYOUT: dict[str, dict[str, list[Any]]] = {
    "VRAM memory": {
        "allocated, reserved and step peak (MiB)": [
            "Multiline",
            ["vram/allocated_mib", "vram/reserved_mib", "vram/peak_mib"],
        ],
        "what held the peak (MiB)": ["Multiline", [r"vram/peak/.*_mib"]],
        "peak of each phase (MiB)": ["Multiline", [r"vram/phase_peak/.*_mib"]],
    },
    "VRAM speed": {
        "GPU utilization (percent)": ["Multiline", ["vram/gpu_utilization_percent"]],
        "data wait (fraction of step time)": ["Multiline", ["vram/data_wait_fraction"]],
        "step time (seconds)": ["Multiline", ["vram/step_seconds"]],
    },
}
"""Charts grouped for TensorBoard's Custom Scalars tab: memory together, speed together."""
LAYOUT_RUN = "vram_layout"
"""The run, below the writer's, that holds :data:`LAYOUT`. TensorBoard keeps one layout per run (the last one written)
and merges the layouts of all runs by category: in a run of its own, the monitor's layout neither replaces a layout
the user writes in theirs nor is replaced by it, whichever comes first."""


class TensorBoardWriter(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` this module uses."""

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None:
        """Write Markdown text under ``tag`` at ``global_step``."""
        ...

    def add_custom_scalars(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        """Write the Custom Scalars layout."""
        ...

    def add_image(self, tag: str, img_tensor: Any, global_step: int | None = None, *, dataformats: str = "CHW") -> None:
        """Write an image under ``tag`` at ``global_step``."""
        ...

    def get_logdir(self) -> str:
        """The directory (or URL) of the run this writer writes."""
        ...

    def close(self) -> None:
        """Flush and close the event file."""
        ...


def layout_for(names: Collection[str]) -> dict[str, dict[str, list[Any]]]:
    """The charts of :data:`LAYOUT` that show at least one of the scalars ``names`` (a chart's tags are regexes).

    A metric never logged (GPU utilization on the CPU) gets no empty chart.

    >>> layout_for({"vram/step_seconds"})
    {'VRAM speed': {'step time (seconds)': ['Multiline', ['vram/step_seconds']]}}
    """
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in LAYOUT.items():
        shown = {
            title: spec
            for title, spec in charts.items()
            if any(re.fullmatch(tag, name) for tag in spec[1] for name in names)
        }
        if shown:
            layout[category] = shown
    return layout


def write_layout(writer: TensorBoardWriter, layout: dict[str, dict[str, list[Any]]]) -> None:
    """The custom-scalars ``layout``, in the run :data:`LAYOUT_RUN` below ``writer``'s (replacing the one before).

    Written by a new writer of ``writer``'s class (``torch.utils.tensorboard``'s or ``tensorboardX``'s
    ``SummaryWriter``, which both take the run's directory first), closed at once.
    """
    new_writer = cast(Callable[[str], TensorBoardWriter], type(writer))
    layout_writer = new_writer(f"{writer.get_logdir().rstrip('/')}/{LAYOUT_RUN}")
    try:
        layout_writer.add_custom_scalars(layout)
    finally:
        layout_writer.close()


def report_images(pngs: FigurePngs) -> dict[str, np.ndarray]:
    """The report's figures as ``(height, width, 3)`` pixels, by TensorBoard tag, from their PNGs (drawn once).

    ``pngs``: :func:`~lightning_vram.render.figure_set.report_pngs`.
    """
    return {tag: png_pixels(png) for tag, png in pngs.items()}
