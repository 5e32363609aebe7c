"""Figures of a report, drawn with matplotlib for TensorBoard and the HTML page.

Figures are built as ``Figure`` objects and saved to PNG directly: headless, and without pyplot, so the user's
matplotlib backend and pyplot state are left alone. Their margins are fixed in inches (:func:`margins`), not found by
a layout engine: a constrained layout draws every text of the figure once more before ``savefig`` draws it (half a
figure's cost), and the texts here are bounded (labels shortened, sizes fixed). Text from the user's model (module
and class names) is drawn literally (``parse_math=False``: a ``$`` never starts mathtext) and shortened; a figure's
size is bounded whatever the report holds.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lightning_vram.records import ModuleProfile, Phase, PhasePeak, StepPoint
from lightning_vram.render.text import module_text
from lightning_vram.units import format_bytes

SHOW_MARKERS_BELOW = 50
"""Series with this many points or fewer get a marker on each."""
MAX_MODULE_BARS = 30
"""The modules figure shows at most this many (the largest); the tables list them all."""
MAX_LABEL_CHARACTERS = 60
"""Longer module labels are shortened in the middle."""
MIN_LINE_POINTS = 3
"""A series with fewer points is said in words, not plotted (one point on a made-up axis reads as a trend)."""

CATEGORY_COLOURS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "other": "#8C8C8C",
}


CHARACTER_INCHES = 0.075
"""The width of one character of a "small" tick label (8.3 pt DejaVu Sans), with room to spare, in inches."""


def margins(figure: Figure, left: float, right: float, top: float, bottom: float, **spacing: float) -> None:
    """Place the axes ``left``, ``right``, ``top`` and ``bottom`` inches inside ``figure``'s edges (fixed margins).

    ``spacing``: ``wspace`` / ``hspace`` between panels, as ``Figure.subplots_adjust`` takes them.
    """
    width, height = figure.get_size_inches()
    figure.subplots_adjust(
        left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height, **spacing
    )


def _binary_scale(largest: float) -> tuple[float, str]:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if largest >= factor:
            return factor, unit
    return 1, "B"


def breakdown_figure(phases: dict[Phase, PhasePeak]) -> Figure:
    """Stacked bars: what held memory at each phase's peak."""
    figure = Figure(figsize=(6.4, 3.6))
    margins(figure, left=0.75, right=0.15, top=0.35, bottom=0.35)
    axes = figure.subplots()
    present = [(phase, phases[phase]) for phase in Phase if phase in phases]
    factor, unit = _binary_scale(max((peak.peak_bytes for _, peak in present), default=1))
    labels = [phase.value for phase, _ in present]
    bottoms = [0.0] * len(present)
    for category, colour in CATEGORY_COLOURS.items():
        values = []
        for _, peak in present:
            value = peak.breakdown.to_dict()[category] if peak.breakdown is not None else None
            values.append((value or 0) / factor)
        if any(values):
            axes.bar(labels, values, bottom=bottoms, color=colour, label=category.replace("_", " "))
            bottoms = [bottom + value for bottom, value in zip(bottoms, values, strict=True)]
    for index, (_, peak) in enumerate(present):
        if peak.breakdown is None:
            axes.bar(labels[index], peak.peak_bytes / factor, color="#DDDDDD", label="not attributed")
    axes.set_ylabel(f"memory at the phase's peak ({unit})")
    axes.set_title("What held memory at each phase's peak")
    axes.legend(fontsize="small", loc="upper right")
    return figure


def short_label(text: str, limit: int = MAX_LABEL_CHARACTERS) -> str:
    """``text`` on one line, at most ``limit`` characters: the middle gives way to an ellipsis.

    >>> short_label("encoder.layers.11.attention.output.dense", limit=20)
    'encoder.l…tput.dense'
    """
    text = " ".join(text.splitlines()).encode("utf-8", "backslashreplace").decode("utf-8")  # no font has surrogates
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return f"{text[:head]}…{text[len(text) - (limit - 1 - head) :]}"


def too_few_steps_text(points: Sequence[StepPoint], sampled_only: bool = False) -> str:
    """What the memory-over-steps figure says instead of a line when it has fewer than :data:`MIN_LINE_POINTS`.

    ``sampled_only``: only sampled steps were measured (on the CPU, which has no allocator to read at every step):
    the sentence says how to sample more.

    >>> too_few_steps_text([StepPoint(2, 3 * 1024**2)])
    'Only 1 step measured (step 2: 3.0 MiB): a line needs 3 or more.'
    """
    steps = ", ".join(f"step {point.step}: {format_bytes(point.peak_bytes)}" for point in points)
    plural = "s" if len(points) != 1 else ""
    text = f"Only {len(points)} step{plural} measured ({steps}): a line needs {MIN_LINE_POINTS} or more."
    if sampled_only:
        text += (
            " On the CPU only sampled steps are measured: VramMonitor(attribution_every_n_steps=N) samples every Nth."
        )
    return text


def memory_over_steps_figure(points: Sequence[StepPoint], capacity: str | None, sampled_only: bool = False) -> Figure:
    """The peak of each recent step; ``capacity`` (in words, see ``render.text.capacity_text``) goes in the title.

    With fewer than :data:`MIN_LINE_POINTS` steps the figure says so in a sentence (:func:`too_few_steps_text`, told
    whether only sampled steps were measured), without axes.
    """
    figure = Figure(figsize=(6.4, 3.2))
    if len(points) < MIN_LINE_POINTS:
        figure.text(0.5, 0.6, "Peak memory of each step", ha="center", va="center", size="large")
        figure.text(0.5, 0.4, too_few_steps_text(points, sampled_only), ha="center", va="center", wrap=True)
        return figure
    margins(figure, left=0.75, right=0.2, top=0.35, bottom=0.55)
    axes = figure.subplots()
    factor, unit = _binary_scale(max((point.peak_bytes for point in points), default=1))
    marker = "o" if len(points) <= SHOW_MARKERS_BELOW else None  # sparse series (CPU: sampled steps only)
    axes.plot(
        [point.step for point in points],
        [point.peak_bytes / factor for point in points],
        color="#4C72B0",
        marker=marker,
    )
    axes.set_xlabel("training batch")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at batch 2.5
    axes.set_ylabel(f"step peak ({unit})")
    title = "Peak memory of each step"
    if capacity:
        title += f" (capacity {capacity})"
    axes.set_title(title, parse_math=False)
    axes.set_ylim(bottom=0)
    return figure


def modules_figure(modules: Sequence[ModuleProfile]) -> Figure:
    """Horizontal bars: the modules that saved the most activations for backward, largest on top, in their order.

    At most :data:`MAX_MODULE_BARS` bars; names are drawn as plain text (never mathtext) and shortened.
    """
    shown = list(modules)[:MAX_MODULE_BARS][::-1]
    figure = Figure(figsize=(6.4, 0.4 * len(shown) + 1.2))
    labels = [short_label(module_text(row)) for row in shown]
    longest = max((len(label) for label in labels), default=0)
    margins(figure, left=CHARACTER_INCHES * longest + 0.2, right=0.25, top=0.35, bottom=0.55)
    axes = figure.subplots()
    factor, unit = _binary_scale(max((row.activation_bytes for row in shown), default=1))
    positions = list(range(len(shown)))
    axes.barh(positions, [row.activation_bytes / factor for row in shown])
    axes.set_yticks(positions, labels, parse_math=False)
    axes.set_xlabel(f"activations saved for backward ({unit})", loc="right")  # the labels' side has room
    title = "Modules saving the most activations"
    if len(modules) > len(shown):
        title += f" (largest {len(shown)} of {len(modules)})"
    axes.set_title(title, loc="right")
    axes.tick_params(axis="y", labelsize="small")
    return figure


DPI = 96


def png_bytes(figure: Figure) -> bytes:
    """The figure as PNG bytes (``savefig`` renders PNG on an Agg canvas of its own)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
