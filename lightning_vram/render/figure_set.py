"""The report's figures, each drawn once to PNG: the HTML page and every publisher share the same bytes.

Drawing a figure is the end of a run's costliest part (matplotlib lays out and draws every text of it); a figure
drawn for the TensorBoard image and again for the HTML page cost twice that. :func:`report_pngs` draws each once,
keyed by its TensorBoard tag; :func:`png_pixels` decodes one for a publisher that takes pixels.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
from matplotlib import image

from lightning_vram.records import Report
from lightning_vram.render.figures import breakdown_figure, memory_over_steps_figure, modules_figure, png_bytes
from lightning_vram.render.step_memory import step_memory_figure
from lightning_vram.render.text import capacity_text

BREAKDOWN_TAG = "vram/figures/breakdown"
MEMORY_OVER_STEPS_TAG = "vram/figures/memory_over_steps"
TOP_MODULES_TAG = "vram/figures/top_modules"
FIGURE_TAGS = (BREAKDOWN_TAG, MEMORY_OVER_STEPS_TAG, TOP_MODULES_TAG)
STEP_MEMORY_TAG = "vram/figures/step_memory"
"""The replay's memory during one step (:func:`~lightning_vram.render.step_memory.step_memory_figure`)."""

FigurePngs = Mapping[str, bytes]
"""A report's figures as PNG bytes, by TensorBoard tag; a figure the report has no data for is absent."""


def report_pngs(report: Report) -> dict[str, bytes]:
    """Draw each of the report's figures once, as PNG bytes, by TensorBoard tag."""
    pngs: dict[str, bytes] = {}
    if report.phases:
        pngs[BREAKDOWN_TAG] = png_bytes(breakdown_figure(report.phases))
    if report.recent_peaks:
        capacity = capacity_text(report.device) if report.device.total_bytes else None
        sampled_only = report.device.type == "cpu"  # no allocator: only sampled steps have a peak
        pngs[MEMORY_OVER_STEPS_TAG] = png_bytes(memory_over_steps_figure(report.recent_peaks, capacity, sampled_only))
    if report.modules:
        pngs[TOP_MODULES_TAG] = png_bytes(modules_figure(report.modules))
    if (step_figure := step_memory_figure(report)) is not None:
        pngs[STEP_MEMORY_TAG] = png_bytes(step_figure)
    return pngs


def png_pixels(png: bytes) -> np.ndarray:
    """A PNG as an ``(height, width, 3)`` uint8 array, as TensorBoard's ``add_image`` takes it (HWC)."""
    rgba = image.imread(io.BytesIO(png), format="png")
    return np.asarray(np.round(rgba[:, :, :3] * 255), dtype=np.uint8)
