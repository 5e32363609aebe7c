"""The figure "memory during one step": the replay's live bytes over the step's ops, stacked by part.

One panel for the replayed baseline and, where a piece of advice's change was replayed, one for that change beside
it, on the same memory scale: forward, backward and optimizer step shaded, the peak marked with its value and the
module (else the op) running at it. Drawn with matplotlib without pyplot, like :mod:`~lightning_vram.render.figures`.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from lightning_vram.records import Phase, ReplayedStep, Report, StepTimeline, advised_variant
from lightning_vram.render.figures import CATEGORY_COLOURS, margins, short_label
from lightning_vram.units import format_bytes

MIB = 1024**2
"""The memory axis is in binary mebibytes."""
PART_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations saved for backward",
    "other": "temporaries and other",
}
"""Each part of a timeline point, as the legend names it, in stacking order (bottom first)."""
PHASE_SHADES = {Phase.FORWARD: "#EAF1FB", Phase.BACKWARD: "#FBEFE6", Phase.OPTIMIZER: "#EAF5EC"}
"""The background of each phase's span of ops."""
TITLE_CHARACTERS = 70
"""A panel's title names the change in at most this many characters."""
HEADROOM = 1.45
"""The memory axis reaches this many times the higher peak, leaving room for the peak's label of two lines below the
phases' names (at 1.25 the label ran into them: "peak 176.5 MiBackward")."""
LEGEND_ROWS = {1: 2, 2: 1}
"""Rows the legend's five parts take under one panel or two (one row is wider than one panel)."""


def step_memory_figure(report: Report) -> Figure | None:
    """Memory during one replayed step, for the baseline and the top advice's change; ``None`` without a timeline."""
    simulation = report.simulation
    baseline = simulation.baseline if simulation is not None and simulation.skipped is None else None
    if baseline is None or baseline.timeline is None:
        return None
    panels: list[tuple[str, StepTimeline]] = [(_title("baseline, the step as it runs", baseline), baseline.timeline)]
    variant = advised_variant(simulation, report.advice)
    if variant is not None and variant.replayed is not None and variant.replayed.timeline is not None:
        panels.append((_title(f"advised: {variant.change.label}", variant.replayed), variant.replayed.timeline))
    rows = LEGEND_ROWS[len(panels)]
    legend_inches = 0.2 * rows
    figure = Figure(figsize=(6.4 * len(panels), 4.0 + legend_inches))
    # titles of two lines above; the axis label and the legend below
    margins(figure, left=0.7, right=0.15, top=0.95, bottom=0.75 + legend_inches, wspace=0.05)
    axes_row = figure.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    top = max(timeline.peak.total for _, timeline in panels) * HEADROOM / MIB
    for axes, (title, timeline) in zip(axes_row, panels, strict=True):
        _draw_panel(axes, timeline, title, top)
    if len(panels) > 1:
        axes_row[1].axhline(baseline.timeline.peak.total / MIB, color="black", linestyle="--", linewidth=0.8)
        axes_row[1].annotate(
            "baseline's peak",
            (0, baseline.timeline.peak.total / MIB),
            xytext=(4, 3),
            textcoords="offset points",
            fontsize="small",
        )
    axes_row[0].set_ylabel("live memory (MiB)")
    handles, labels = axes_row[0].get_legend_handles_labels()
    columns = -(-len(labels) // rows)
    figure.legend(handles, labels, loc="lower center", ncols=columns, fontsize="small", frameon=False)
    figure.suptitle("Memory during one training step (replayed under fake tensors)")
    return figure


def _title(what: str, replayed: ReplayedStep) -> str:
    """A panel's title: what was replayed (shortened), then its peak (n/a without phases), on two lines."""
    peak = replayed.reported_bytes(replayed.reported_peak) if replayed.phases else None
    return f"{short_label(what, TITLE_CHARACTERS)}\npeak {format_bytes(peak)}"


def _draw_panel(axes: Axes, timeline: StepTimeline, title: str, top: float) -> None:
    """One replay's stacked parts over its ops, its phases shaded, its peak marked."""
    ops = [point.op for point in timeline.points]
    series = [[getattr(point, part) / MIB for point in timeline.points] for part in PART_LABELS]
    for start, end, phase in _phase_spans(timeline):
        axes.axvspan(start, end, color=PHASE_SHADES[phase], zorder=0)
        axes.text((start + end) / 2, top * 0.97, phase.value, ha="center", va="top", fontsize="small", color="#555555")
    axes.stackplot(
        ops,
        *series,
        labels=list(PART_LABELS.values()),
        colors=[CATEGORY_COLOURS[part] for part in PART_LABELS],
        step="post",
        zorder=2,
    )
    peak = timeline.peak
    where = timeline.peak_module or (f"op {timeline.peak_op}" if timeline.peak_op else peak.phase.value)
    axes.plot([peak.op], [peak.total / MIB], marker="v", color="black", zorder=3)
    axes.annotate(
        f"peak {format_bytes(peak.total)}\nin {peak.phase.value}, at {short_label(where, 40)}",
        (peak.op, peak.total / MIB),
        xytext=(0, 8),
        textcoords="offset points",
        ha=_alignment(peak.op / max(timeline.ops, 1)),
        va="bottom",
        fontsize="small",
        parse_math=False,
        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},  # over a line
        zorder=4,
    )
    axes.set_xlim(0, max(timeline.ops, 1))
    axes.set_ylim(0, top)
    axes.set_xlabel("ops run in the step")
    axes.set_title(title, fontsize="medium", parse_math=False)


def _alignment(fraction: float) -> str:
    """Where a label at ``fraction`` of the axis's width is anchored, so that it stays inside the axes."""
    if fraction < 0.2:
        return "left"
    return "right" if fraction > 0.8 else "center"


def _phase_spans(timeline: StepTimeline) -> list[tuple[int, int, Phase]]:
    """(first op, end op, phase) of each phase's span, in step order."""
    starts = timeline.phase_starts
    ends = [start for _, start in starts[1:]] + [timeline.ops]
    return [(start, end, phase) for (phase, start), end in zip(starts, ends, strict=True) if end > start]
