"""The batch shapes a run saw: each batch tensor's range per dimension, the largest batch, and its peak per length.

Variable-length training (language models padded per batch, images of several sizes) needs the worst batch, not the
sampled one: the run's largest batch is replayed when it first arrives, and the report's advice refers to it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorShapes:
    """One batch tensor's shape range over the run.

    ``name`` says where it sits in the batch (``batch[0]``, ``batch['input_ids']``); ``smallest`` and ``largest``
    are the least and greatest size seen along each dimension (elements).
    """

    name: str
    smallest: tuple[int, ...]
    largest: tuple[int, ...]

    @property
    def varying(self) -> tuple[int, ...]:
        """The dimensions whose size changed between batches."""
        return tuple(
            dim for dim, (low, high) in enumerate(zip(self.smallest, self.largest, strict=False)) if low != high
        )


@dataclass(frozen=True)
class LengthPeak:
    """A batch length and the peak its step was replayed at (bytes).

    ``length`` is the size along the batch's varying dimension (tokens for a language model); ``step`` is the
    training step whose batch was replayed, ``None`` for a length predicted before it was seen (``max_length``; for
    ``max_shape``, the size along the first dimension it changes).
    """

    length: int
    peak_bytes: int
    step: int | None

    @property
    def predicted(self) -> bool:
        """Whether no batch of this length was seen: the figure comes from a resized batch."""
        return self.step is None


@dataclass(frozen=True)
class BatchShapes:
    """The batch shapes of a run.

    ``largest_step`` is the step whose batch held the most elements (``largest_elements``, over all its tensors);
    ``replayed_step`` the step of the largest batch that was replayed, the one the advice and fit table refer to
    (``None`` when none was); ``lengths`` each replayed length with its peak, shortest first; ``length_counts``
    each batch length seen (tokens) with how many batches had it, shortest first (empty in reports from before).
    """

    tensors: tuple[TensorShapes, ...]
    largest_step: int
    largest_elements: int
    replayed_step: int | None = None
    lengths: tuple[LengthPeak, ...] = ()
    length_counts: tuple[tuple[int, int], ...] = ()

    @property
    def varies(self) -> bool:
        """Whether any batch tensor changed shape during the run."""
        return any(tensor.varying for tensor in self.tensors)


def length_percentile(counts: tuple[tuple[int, int], ...], share: float) -> int | None:
    """The shortest length (tokens) at least ``share`` of the batches do not exceed, from (length, batches) pairs.

    ``None`` without any batch.

    >>> length_percentile(((16, 19), (128, 1)), 0.95), length_percentile(((16, 18), (128, 2)), 0.95)
    (16, 128)
    """
    total = sum(count for _, count in counts)
    if not total:
        return None
    seen = 0
    for length, count in sorted(counts):
        seen += count
        if seen >= share * total:
            return length
    return max(length for length, _ in counts)
