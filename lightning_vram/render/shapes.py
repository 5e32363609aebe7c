"""What the report says about the batch shapes a run saw: a sentence and the peak per length (plain text)."""

from __future__ import annotations

from lightning_vram.records import BatchShapes, LengthPeak
from lightning_vram.records.shapes import length_percentile
from lightning_vram.render.simulation import Table
from lightning_vram.units import format_bytes


def shapes_sentence(shapes: BatchShapes) -> str:
    """Which dimensions varied, the largest batch, the length 95% of batches keep within, the step advised on."""
    varying = [
        f"{tensor.name} dim {dim}: {tensor.smallest[dim]}-{tensor.largest[dim]}"
        for tensor in shapes.tensors
        for dim in tensor.varying
    ]
    text = (
        f"Batch shapes varied ({'; '.join(varying)})" if varying else "Every batch had the same shapes"
    ) + f"; the largest batch ({shapes.largest_elements:,} elements) was step {shapes.largest_step}'s."
    if len(shapes.length_counts) > 1:
        longest = shapes.length_counts[-1][0]
        text += f" 95% of the batches were at most {length_percentile(shapes.length_counts, 0.95):,} long"
        text += f" (the longest {longest:,})."
    if shapes.replayed_step is not None:
        text += f" The advice and fit table come from the replay of step {shapes.replayed_step}'s batch."
    return text


def length_cell(row: LengthPeak) -> str:
    """``"512: 1.2 GiB"``, with ``predicted`` where no batch of that length was seen."""
    return f"{row.length:,}: {format_bytes(row.peak_bytes)}" + (" predicted" if row.predicted else "")


def lengths_line(shapes: BatchShapes) -> str | None:
    """``"peak per length: 128: 0.7 GiB; 512: 1.2 GiB; 2,048: 4.1 GiB predicted"`` (``None`` without rows)."""
    if not shapes.lengths:
        return None
    return "peak per length: " + "; ".join(length_cell(row) for row in shapes.lengths)


def lengths_table(shapes: BatchShapes) -> Table | None:
    """The replayed peak per batch length, shortest first (``None`` without rows)."""
    if not shapes.lengths:
        return None
    rows = tuple(
        (
            f"{row.length:,}",
            format_bytes(row.peak_bytes),
            "predicted (the longest expected)" if row.step is None else f"step {row.step}",
        )
        for row in shapes.lengths
    )
    return Table(("length", "replayed peak", "batch"), (True, True, False), rows)
