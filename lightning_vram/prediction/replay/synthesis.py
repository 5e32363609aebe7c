"""A step's allocation sequence at any batch size, from two replays: the fit table's search in the simulator.

The ops of a training step do not change with the batch size for almost all models, and each allocation's size is
affine in it (``a + k * batch``, integers). Two replays whose sequences have the same structure (length, event kinds,
streams, phase marks, and which malloc each free returns, compared by position: block ids are storage keys) give
every allocation's size at any batch exactly. A size whose bytes per sample are not a whole number is not affine,
and a structure that differs between the two is batch-dependent: neither is synthesized.
"""

from __future__ import annotations

from array import array

from lightning_vram.records import AllocationSequence, Phase

_Shape = tuple[object, ...]
"""A sequence's structure: per event, its phase, ``("malloc", stream)`` or ``("free", malloc position)``."""


def _shape(sequence: AllocationSequence) -> tuple[_Shape, array[int]]:
    """The sequence's structure (block ids as the position of the malloc that made them) and its malloc sizes.

    Frees one after another (no malloc or phase mark between them) are one set, in the order of the mallocs they
    return: the allocator holds the same blocks after them whatever their order, and a step's frees of a container
    (autocast's cache of cast weights, cleared at its exit) come in the order of their addresses' hashes.

    >>> one = (("malloc", 7, 1000, 0), ("malloc", 8, 512, 0), ("free", 7, 0, 0), ("free", 8, 0, 0))
    >>> two = (("malloc", 3, 1800, 0), ("malloc", 4, 512, 0), ("free", 4, 0, 0), ("free", 3, 0, 0))
    >>> _shape(one)[0] == _shape(two)[0]
    True
    """
    live: dict[int, int] = {}
    unmatched: dict[int, int] = {}
    shape: list[object] = []
    frees: list[int] = []
    sizes = array("q")
    for position, event in enumerate(sequence):
        if not isinstance(event, Phase) and event[0] == "free":
            made = live.pop(event[1], None)
            if made is None:  # freed without a malloc in the step: named by order of first appearance
                made = -1 - unmatched.setdefault(event[1], len(unmatched))
            frees.append(made)
            continue
        shape.extend(("free", made) for made in sorted(frees))
        frees.clear()
        if isinstance(event, Phase):
            shape.append(event)
        else:
            live[event[1]] = position
            shape.append(("malloc", event[3]))
            sizes.append(event[2])
    shape.extend(("free", made) for made in sorted(frees))
    return tuple(shape), sizes


class AffineSteps:
    """The allocation sequences of one step structure, each malloc's size ``base + slope * (batch - batch_size)``.

    Built by :meth:`fit` from two replays; :meth:`at` gives the sequence at any batch (block ids the first
    replay's), :meth:`agrees` checks a third replay against it exactly.

    >>> one = (Phase.FORWARD, ("malloc", 7, 1000, 0), ("malloc", 8, 512, 0), ("free", 7, 0, 0))
    >>> two = (Phase.FORWARD, ("malloc", 3, 1800, 0), ("malloc", 4, 512, 0), ("free", 3, 0, 0))
    >>> AffineSteps.fit(one, 4, two, 8).at(10)
    (<Phase.FORWARD: 'forward'>, ('malloc', 7, 2200, 0), ('malloc', 8, 512, 0), ('free', 7, 0, 0))
    """

    def __init__(self, template: AllocationSequence, batch_size: int, base: array[int], slope: array[int]) -> None:
        self._template = template
        self._batch_size = batch_size
        self._base = base
        self._slope = slope
        self._shape = _shape(template)[0]
        self._mallocs = tuple(
            (position, event[1], event[3])
            for position, event in enumerate(template)
            if not isinstance(event, Phase) and event[0] == "malloc"
        )
        """Each malloc's position in the template, block and stream, in order (as ``base`` and ``slope``)."""

    @classmethod
    def fit(
        cls, first: AllocationSequence, first_batch: int, second: AllocationSequence, second_batch: int
    ) -> AffineSteps | None:
        """The law through two replays of different batch sizes.

        ``None`` where their structures differ or a size's bytes per sample are not a whole number (not affine
        with integer coefficients).
        """
        if first_batch == second_batch or len(first) != len(second):
            return None
        shape, base = _shape(first)
        other_shape, other = _shape(second)
        if shape != other_shape:
            return None
        span = second_batch - first_batch
        slope = array("q")
        for low, high in zip(base, other, strict=True):
            per_sample, rest = divmod(high - low, span)
            if rest:
                return None
            slope.append(per_sample)
        return cls(first, first_batch, base, slope)

    def sizes(self, batch_size: int) -> array[int] | None:
        """Each malloc's size at ``batch_size``, in order; ``None`` where one would be negative."""
        offset = batch_size - self._batch_size
        sizes = array("q", (base + slope * offset for base, slope in zip(self._base, self._slope, strict=True)))
        return None if any(size < 0 for size in sizes) else sizes

    def at(self, batch_size: int) -> AllocationSequence | None:
        """The step's allocation sequence at ``batch_size``; ``None`` where a size would be negative."""
        offset = batch_size - self._batch_size
        events = list(self._template)
        for (position, block, stream), base, slope in zip(self._mallocs, self._base, self._slope, strict=True):
            size = base + slope * offset
            if size < 0:
                return None
            events[position] = ("malloc", block, size, stream)
        return tuple(events)

    def agrees(self, sequence: AllocationSequence, batch_size: int) -> bool:
        """Whether a replay of ``batch_size`` has this structure and exactly the sizes the law gives there."""
        shape, sizes = _shape(sequence)
        return shape == self._shape and sizes == self.sizes(batch_size)


def synthesize(
    first: AllocationSequence, first_batch: int, second: AllocationSequence, second_batch: int, batch_size: int
) -> AllocationSequence | None:
    """The allocation sequence at ``batch_size`` from replays at two others (:class:`AffineSteps`).

    ``None`` where their structures differ, a size is not affine, or one would be negative there.

    >>> one = (("malloc", 1, 100, 0), ("free", 1, 0, 0))
    >>> synthesize(one, 1, (("malloc", 5, 300, 0), ("free", 5, 0, 0)), 3, 6)
    (('malloc', 1, 600, 0), ('free', 1, 0, 0))
    >>> synthesize(one, 1, (("malloc", 5, 301, 0), ("free", 5, 0, 0)), 3, 6) is None  # 100.5 B per sample
    True
    """
    law = AffineSteps.fit(first, first_batch, second, second_batch)
    return None if law is None else law.at(batch_size)
