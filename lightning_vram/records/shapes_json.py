"""The JSON form of :mod:`lightning_vram.records.shapes`, both ways."""

from __future__ import annotations

from typing import Any

from lightning_vram.records.json_reader import FormatError, Reader, as_int, kind_of, member
from lightning_vram.records.shapes import BatchShapes, LengthPeak, TensorShapes


def batch_shapes_to_dict(shapes: BatchShapes | None) -> dict[str, Any] | None:
    """``shapes`` as JSON-ready data (``None`` stays ``None``)."""
    if shapes is None:
        return None
    return {
        "tensors": [
            {"name": tensor.name, "smallest": list(tensor.smallest), "largest": list(tensor.largest)}
            for tensor in shapes.tensors
        ],
        "largest_step": shapes.largest_step,
        "largest_elements": shapes.largest_elements,
        "replayed_step": shapes.replayed_step,
        "lengths": [{"length": row.length, "peak_bytes": row.peak_bytes, "step": row.step} for row in shapes.lengths],
        "length_counts": [{"length": length, "batches": count} for length, count in shapes.length_counts],
    }


def _sizes(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise FormatError(f"{where} must be a list of sizes, got {kind_of(value)}")
    return tuple(as_int(item, f"{where}[{index}]", 0) for index, item in enumerate(value))


def _tensor(data: Any, where: str) -> TensorShapes:
    fields = Reader(data, where)
    smallest = _sizes(fields.raw("smallest"), member(where, "smallest"))
    largest = _sizes(fields.raw("largest"), member(where, "largest"))
    if len(smallest) != len(largest):
        raise FormatError(f"{where}: smallest and largest must have as many dimensions, got {smallest} and {largest}")
    return TensorShapes(fields.text("name"), smallest, largest)


def _length(data: Any, where: str) -> LengthPeak:
    fields = Reader(data, where)
    return LengthPeak(fields.integer("length"), fields.integer("peak_bytes"), fields.optional_integer("step"))


def _length_count(data: Any, where: str) -> tuple[int, int]:
    fields = Reader(data, where)
    return fields.integer("length"), fields.integer("batches")


def batch_shapes_from_dict(data: Any, where: str) -> BatchShapes | None:
    """Read back what :func:`batch_shapes_to_dict` wrote (``None`` stays ``None``).

    Raises:
        FormatError: a field is missing or mistyped (named with ``where``).
    """
    if data is None:
        return None
    fields = Reader(data, where)
    return BatchShapes(
        tensors=tuple(fields.each("tensors", _tensor)),
        largest_step=fields.integer("largest_step"),
        largest_elements=fields.integer("largest_elements"),
        replayed_step=fields.optional_integer("replayed_step"),
        lengths=tuple(fields.each("lengths", _length)),
        length_counts=tuple(fields.each("length_counts", _length_count)) if fields.has("length_counts") else (),
    )
