"""The JSON form of a step's timeline, both ways: what the report's ``simulation`` section carries of it.

``points`` is a list of ``[op, phase, parameters, gradients, optimizer_state, activations, other]`` (bytes after
op number ``op``), compact enough for at most 1,000 points; the peak is found again as the first highest point.
"""

from __future__ import annotations

from typing import Any

from lightning_vram.records.json_reader import FormatError, Reader, as_int, kind_of
from lightning_vram.records.measured import Phase
from lightning_vram.records.measured_json import phase_from_text
from lightning_vram.records.timeline import StepTimeline, TimelinePoint

POINT_FIELDS = ("op", "phase", "parameters", "gradients", "optimizer_state", "activations", "other")
"""What each point's list holds, in order."""


def timeline_to_dict(timeline: StepTimeline | None) -> dict[str, Any] | None:
    """A timeline's JSON object (``None`` for none)."""
    if timeline is None:
        return None
    return {
        "ops": timeline.ops,
        "phase_starts": [[phase.value, op] for phase, op in timeline.phase_starts],
        "peak_module": timeline.peak_module,
        "peak_op": timeline.peak_op,
        "points": [_point_to_list(point) for point in timeline.points],
    }


def _point_to_list(point: TimelinePoint) -> list[int | str]:
    """A point as :data:`POINT_FIELDS` lists it."""
    parts = [point.parameters, point.gradients, point.optimizer_state, point.activations, point.other]
    return [point.op, point.phase.value, *parts]


def timeline_from_dict(fields: Reader, key: str) -> StepTimeline | None:
    """The timeline :func:`timeline_to_dict` wrote under ``key`` (``None`` for null)."""
    timeline = fields.optional_child(key)
    if timeline is None:
        return None
    points = tuple(timeline.each("points", _point))
    if not points:
        raise FormatError(f"{key}.points: a timeline has at least one point, got none")
    highest = max(point.total for point in points)
    return StepTimeline(
        points=points,
        ops=timeline.integer("ops"),
        phase_starts=tuple(timeline.each("phase_starts", _phase_start)),
        peak_index=next(index for index, point in enumerate(points) if point.total == highest),
        peak_module=timeline.optional_text("peak_module"),
        peak_op=timeline.optional_text("peak_op"),
    )


def _point(data: Any, where: str) -> TimelinePoint:
    if not isinstance(data, list) or len(data) != len(POINT_FIELDS):
        raise FormatError(f"{where} must be a list of {len(POINT_FIELDS)} values {list(POINT_FIELDS)}")
    op, phase, *parts = data
    if not isinstance(phase, str):
        raise FormatError(f"{where}[1] must be a string, got {kind_of(phase)}")
    counts = [as_int(value, f"{where}[{index}]", 0) for index, value in enumerate(parts, start=2)]
    return TimelinePoint(as_int(op, f"{where}[0]", 0), phase_from_text(phase, f"{where}[1]"), *counts)


def _phase_start(data: Any, where: str) -> tuple[Phase, int]:
    if not isinstance(data, list) or len(data) != 2 or not isinstance(data[0], str):
        raise FormatError(f"{where} must be a list [phase, op]")
    return phase_from_text(data[0], f"{where}[0]"), as_int(data[1], f"{where}[1]", 0)
