"""TensorBoard's custom-scalars layout (the charts of the scalars logged), and the report's figures and tags.

Used by the TensorBoard publisher; works with any writer that has these methods of
``torch.utils.tensorboard.SummaryWriter``. What the monitor writes itself (the layout, the figures, the advice) goes
through a writer of its own (:class:`OwnWriter`), never the logger's.
"""

from __future__ import annotations

import contextlib
import re
import weakref
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
MONITOR_RUN = "vram"
"""The run, below the writer's, that holds what the monitor writes itself: :data:`LAYOUT`, the figures, the advice.

TensorBoard keeps one layout per run (the last one written) and merges the layouts of all runs by category: in a run
of its own, the monitor's layout neither replaces a layout the user writes in theirs nor is replaced by it, whichever
comes first. The figures and the advice are written there too, by :class:`OwnWriter`: a write that fails (a full
disk) fails in the monitor's writer, not in the logger's (a ``SummaryWriter``'s background thread stops at its first
failed write, and every later call of that writer, Lightning's ``finalize`` at the end of fit included, raises it
again). A run of its own, not a second event file in the logger's run: TensorBoard follows only a run's newest event
file, and would stop showing the logger's scalars while training goes on."""


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

    def flush(self) -> None:
        """Write what is pending to the event file; raises what a failed write raised."""
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


class OwnWriter:
    """One writer of ``writer``'s class in the run :data:`MONITOR_RUN` below ``writer``'s, opened at its first write.

    ``torch.utils.tensorboard``'s or ``tensorboardX``'s ``SummaryWriter``, which both take the run's directory first.
    One event file for the run: TensorBoard reads a run's files in name order, and a file per write would sort out of
    the order written (the names end in a counter, "10" before "9"), which made TensorBoard read the last advice
    before an earlier one and drop it. Flushed after each write, so that a write that failed (a full disk) raises
    there, in the monitor's guard; closed when its publisher goes away.
    """

    def __init__(self, writer: TensorBoardWriter) -> None:
        self._writer = writer
        self._own: TensorBoardWriter | None = None

    def get(self) -> TensorBoardWriter:
        """The monitor's writer, opened now if this is its first write."""
        if self._own is None:
            new_writer = cast(Callable[[str], TensorBoardWriter], type(self._writer))
            self._own = new_writer(f"{self._writer.get_logdir().rstrip('/')}/{MONITOR_RUN}")
            weakref.finalize(self, _close, self._own)
        return self._own


def _close(writer: TensorBoardWriter) -> None:
    """Close the monitor's writer, from a finalizer, which must not raise.

    A writer whose file could not be written re-raises its thread's error here (of any type); it said so already, at
    the write, where the guard warned.
    """
    with contextlib.suppress(Exception):
        writer.close()


def write_layout(own: OwnWriter, layout: dict[str, dict[str, list[Any]]]) -> None:
    """The custom-scalars ``layout``, in the run :data:`MONITOR_RUN` (replacing the one before), flushed."""
    writer = own.get()
    writer.add_custom_scalars(layout)
    writer.flush()


def report_images(pngs: FigurePngs) -> dict[str, np.ndarray]:
    """The report's figures as ``(height, width, 3)`` pixels, by TensorBoard tag, from their PNGs (drawn once).

    ``pngs``: :func:`~lightning_vram.render.figure_set.report_pngs`.
    """
    return {tag: png_pixels(png) for tag, png in pngs.items()}
