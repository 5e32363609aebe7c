"""TensorBoard output beyond scalars: a custom-scalars layout, advice as text, and figures.

Used only when a TensorBoardLogger is present; works with any writer that has these methods of
``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np

from lightning_vram.records import Advice, Report
from lightning_vram.render.figures import breakdown_figure, memory_over_steps_figure, modules_figure, rgb_pixels
from lightning_vram.render.step_memory import step_memory_figure
from lightning_vram.render.text import advice_markdown, capacity_text

ADVICE_TAG = "vram/advice"
FIGURE_TAGS = ("vram/figures/breakdown", "vram/figures/memory_over_steps", "vram/figures/top_modules")
STEP_MEMORY_TAG = "vram/figures/step_memory"
"""The replay's memory during one step (:func:`~lightning_vram.render.step_memory.step_memory_figure`)."""

LAYOUT: dict[str, dict[str, list[Any]]] = {
    "VRAM memory": {
        "allocated, reserved and step peak (bytes)": [
            "Multiline",
            ["vram/allocated_bytes", "vram/reserved_bytes", "vram/peak_bytes"],
        ],
        "what held the peak (bytes)": ["Multiline", [r"vram/peak/.*_bytes"]],
        "peak of each phase (bytes)": ["Multiline", [r"vram/phase_peak/.*_bytes"]],
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


def write_layout(writer: TensorBoardWriter) -> None:
    """The custom-scalars layout of the ``vram/...`` scalars, in the run :data:`LAYOUT_RUN` below ``writer``'s.

    Written by a new writer of ``writer``'s class (``torch.utils.tensorboard``'s or ``tensorboardX``'s
    ``SummaryWriter``, which both take the run's directory first), closed at once.
    """
    new_writer = cast(Callable[[str], TensorBoardWriter], type(writer))
    layout_writer = new_writer(f"{writer.get_logdir().rstrip('/')}/{LAYOUT_RUN}")
    try:
        layout_writer.add_custom_scalars(LAYOUT)
    finally:
        layout_writer.close()


def write_advice(writer: TensorBoardWriter, advice: tuple[Advice, ...], step: int) -> None:
    """The run's advice so far, as Markdown text under ``vram/advice``."""
    writer.add_text(ADVICE_TAG, advice_markdown(advice), global_step=step)


def report_images(report: Report) -> dict[str, np.ndarray]:
    """The report's figures as ``(height, width, 3)`` pixels, by TensorBoard tag; absent figures are left out."""
    images: dict[str, np.ndarray] = {}
    if report.phases:
        images[FIGURE_TAGS[0]] = rgb_pixels(breakdown_figure(report.phases))
    if report.recent_peaks:
        capacity = capacity_text(report.device) if report.device.total_bytes else None
        images[FIGURE_TAGS[1]] = rgb_pixels(memory_over_steps_figure(report.recent_peaks, capacity))
    if report.modules:
        images[FIGURE_TAGS[2]] = rgb_pixels(modules_figure(report.modules))
    if (step_figure := step_memory_figure(report)) is not None:
        images[STEP_MEMORY_TAG] = rgb_pixels(step_figure)
    return images


def write_figures(writer: TensorBoardWriter, report: Report, step: int) -> None:
    """The breakdown per phase, memory over steps and the top modules, as images."""
    for tag, pixels in report_images(report).items():
        writer.add_image(tag, pixels, global_step=step, dataformats="HWC")
