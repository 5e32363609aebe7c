"""What the report says about the batch shapes a run saw: a sentence and the peak per length (plain text)."""

from __future__ import annotations

from lightning_vram.records import BatchShapes, LengthPeak
from lightning_vram.records.shapes import TensorShapes, length_percentile
from lightning_vram.render.simulation import Table
from lightning_vram.units import format_bytes

DIMENSION_NAMES = {
    2: ("batch", "length"),
    3: ("batch", "length", "features"),
    4: ("batch", "channels", "height", "width"),
    5: ("batch", "channels", "frames", "height", "width"),
}
"""What each dimension of a batch tensor of that many dimensions holds, by convention: a length only for a sequence
(tokens; ``(batch, length[, features])``), an image's ``(batch, channels, height, width)``."""


def dimension_name(tensor: TensorShapes, dim: int) -> str:
    """What dimension ``dim`` of ``tensor`` holds, by its number of dimensions (``"dim N"`` where none is known).

    >>> dimension_name(TensorShapes("batch[0]", (8, 3, 64, 64), (8, 4, 64, 64)), 1)
    'channels'
    >>> dimension_name(TensorShapes("batch['input_ids']", (8, 128), (8, 512)), 1)
    'length'
    """
    names = DIMENSION_NAMES.get(len(tensor.largest), ())
    return names[dim] if dim < len(names) else f"dim {dim}"


def varying_name(shapes: BatchShapes) -> str:
    """What the batches' first varying dimension holds (``"length"`` where none varies)."""
    return next((dimension_name(tensor, dim) for tensor in shapes.tensors for dim in tensor.varying), "length")


def shapes_sentence(shapes: BatchShapes) -> str:
    """Which dimensions varied, the largest batch, the length 95% of batches keep within, the step advised on."""
    varying = [
        f"{tensor.name} {dimension_name(tensor, dim)} (dim {dim}): {tensor.smallest[dim]}-{tensor.largest[dim]}"
        for tensor in shapes.tensors
        for dim in tensor.varying
    ]
    text = (
        f"Batch shapes varied ({'; '.join(varying)})" if varying else "Every batch had the same shapes"
    ) + f"; the largest batch ({shapes.largest_elements:,} elements) was step {shapes.largest_step}'s."
    if len(shapes.length_counts) > 1:
        longest = shapes.length_counts[-1][0]
        what = varying_name(shapes)
        text += f" 95% of the batches had {what} at most {length_percentile(shapes.length_counts, 0.95):,}"
        text += f" (the largest {longest:,})."
    if shapes.replayed_step is not None:
        text += f" The advice and fit table come from the replay of step {shapes.replayed_step}'s batch."
    return text


def shows_lengths(shapes: BatchShapes) -> bool:
    """Whether the report has a "Batch shapes" section: the shapes varied, or a length was predicted before it was seen.

    A length is predicted for ``max_length``, ``max_shape`` or the DataLoader's own longest; on the CPU (no preflight
    verdict) its peak is all those options give, however alike the batches were.
    """
    return shapes.varies or any(row.predicted for row in shapes.lengths)


def longest_line(shapes: BatchShapes) -> str | None:
    """The peak predicted at the longest length expected, beside the longest replayed; ``None`` where none was.

    >>> longest_line(BatchShapes((), 0, 2048, 2, (LengthPeak(128, 100 * 2**20, 2), LengthPeak(512, 400 * 2**20, None))))
    "peak at the longest length expected (512): 400.0 MiB predicted; at 128 (step 2's batch, replayed): 100.0 MiB"
    """
    predicted = [row for row in shapes.lengths if row.predicted]
    if not predicted:
        return None
    longest = max(predicted, key=lambda row: row.length)
    text = f"peak at the longest {varying_name(shapes)} expected ({longest.length:,}):"
    text += f" {format_bytes(longest.peak_bytes)} predicted"
    seen = [row for row in shapes.lengths if not row.predicted]
    if seen:
        row = max(seen, key=lambda row: (row.length, row.peak_bytes))
        text += f"; at {row.length:,} (step {row.step}'s batch, replayed): {format_bytes(row.peak_bytes)}"
    return text


def length_cell(row: LengthPeak) -> str:
    """``"512: 1.2 GiB"``, with ``predicted`` where no batch of that length was seen."""
    return f"{row.length:,}: {format_bytes(row.peak_bytes)}" + (" predicted" if row.predicted else "")


def lengths_line(shapes: BatchShapes) -> str | None:
    """``"peak per length: 128: 0.7 GiB; 512: 1.2 GiB; 2,048: 4.1 GiB predicted"`` (``None`` without rows)."""
    if not shapes.lengths:
        return None
    return f"peak per {varying_name(shapes)}: " + "; ".join(length_cell(row) for row in shapes.lengths)


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
    return Table((varying_name(shapes), "replayed peak", "batch"), (True, True, False), rows)
