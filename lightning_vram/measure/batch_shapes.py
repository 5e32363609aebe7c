"""The shapes of every training batch, read on the hot path: each tensor's size range per dimension, the largest batch.

Shapes only (no data, no device synchronisation). The batch is walked through built-in containers (tuples, lists,
dicts, ``UserDict`` such as transformers' ``BatchEncoding``), at most :data:`MAX_DEPTH` deep and
:data:`MAX_TENSORS` tensors; the paths found on the first batch are kept and read directly on the next ones,
walked again only where the structure changed. Other objects are not entered: no user code runs.
"""

from __future__ import annotations

from collections import UserDict
from typing import Any

import torch
from torch import Tensor

from lightning_vram.records import BatchShapes, TensorShapes

MAX_DEPTH = 4
"""How deep the walk enters nested containers."""
MAX_TENSORS = 32
"""How many of a batch's tensors are recorded."""
MAX_LENGTHS = 4096
"""How many distinct batch lengths are counted; a length first seen past them is not (its batches go uncounted)."""

Path = tuple[Any, ...]


def batch_tensors(batch: Any) -> list[tuple[Path, Tensor]]:
    """The tensors of ``batch`` with their paths (indices and keys), within the walk's bounds."""
    found: list[tuple[Path, Tensor]] = []
    _walk(batch, (), found)
    return found


def _children(value: Any) -> Any:
    if isinstance(value, tuple):  # named tuples too, through tuple's own iteration
        return enumerate(tuple.__iter__(value))
    if type(value) is list:
        return enumerate(list.__iter__(value))
    if isinstance(value, dict):
        return dict.items(value)
    if isinstance(value, UserDict) and type(vars(value).get("data")) is dict:
        return dict.items(vars(value)["data"])
    return None


def _walk(value: Any, path: Path, found: list[tuple[Path, Tensor]]) -> None:
    if isinstance(value, Tensor):
        found.append((path, value))
        return
    if len(path) >= MAX_DEPTH:
        return
    children = _children(value)
    if children is None:
        return
    for key, child in children:
        if len(found) >= MAX_TENSORS:
            return
        _walk(child, (*path, key), found)


def _at(batch: Any, path: Path) -> Any:
    """What ``path`` leads to in ``batch`` through built-in reads, or ``None`` where it leads nowhere."""
    value = batch
    for key in path:
        if isinstance(value, tuple) and type(key) is int and key < tuple.__len__(value):
            value = tuple.__getitem__(value, key)
        elif type(value) is list and type(key) is int and key < len(value):
            value = list.__getitem__(value, key)
        elif isinstance(value, dict):
            value = dict.get(value, key)
        elif isinstance(value, UserDict) and type(vars(value).get("data")) is dict:
            value = dict.get(vars(value)["data"], key)
        else:
            return None
    return value


def path_name(path: Path) -> str:
    """How a path reads in the report: ``batch[0]``, ``batch['input_ids']``, or ``batch`` for the batch itself.

    >>> path_name((0, "input_ids")), path_name(())
    ("batch[0]['input_ids']", 'batch')
    """
    return "batch" + "".join(f"[{key!r}]" for key in path)


class ShapeRecorder:
    """Each batch tensor's smallest and largest size per dimension, and the step of the largest batch.

    A batch's size is the number of elements of all its recorded tensors (tokens per batch for a language model).
    """

    def __init__(self) -> None:
        self._paths: list[Path] = []
        self._smallest: list[list[int]] = []
        self._largest: list[list[int]] = []
        self._last: list[torch.Size] = []  # the last batch's shapes
        self.elements = 0
        """The elements of the last batch recorded."""
        self.largest_elements = 0
        """The most elements one batch held."""
        self.largest_step: int | None = None
        """The step of that batch (``None`` before any batch)."""
        self.length_counts: dict[int, int] = {}
        """How many batches had each length (tokens): dimension 1 of the first tensor with two or more, as
        :func:`lightning_vram.prediction.replay.batches.resize_length` reads it; at most :data:`MAX_LENGTHS` lengths."""
        self._last_length: int | None = None

    def _tensors(self, batch: Any) -> list[Tensor] | None:
        """The batch's tensors along the cached paths; ``None`` where the structure changed."""
        tensors: list[Tensor] = []
        for path in self._paths:
            value = _at(batch, path)
            if not isinstance(value, Tensor) or value.dim() != len(self._smallest[len(tensors)]):
                return None
            tensors.append(value)
        return tensors

    def observe(self, step: int, batch: Any) -> bool:
        """Record ``batch`` (of training step ``step``). Returns whether it is the largest so far."""
        tensors = self._tensors(batch) if self._paths else None
        if tensors is None:
            found = batch_tensors(batch)
            if not found:
                return False
            if [path for path, _ in found] != self._paths:
                self._paths = [path for path, _ in found]
                self._smallest = [list(tensor.shape) for _, tensor in found]
                self._largest = [list(tensor.shape) for _, tensor in found]
            tensors = [tensor for _, tensor in found]
            self._last = []
        shapes = [tensor.shape for tensor in tensors]
        if shapes == self._last:  # the same shapes as the last batch (every step of a fixed-shape run): recorded
            self._count_length(self._last_length)
            return False
        self._last = shapes
        self._last_length = next((int(shape[1]) for shape in shapes if len(shape) >= 2), None)
        self._count_length(self._last_length)
        elements = 0
        for tensor, shape, smallest, largest in zip(tensors, shapes, self._smallest, self._largest, strict=False):
            for dim, size in enumerate(shape):
                if size < smallest[dim]:
                    smallest[dim] = size
                elif size > largest[dim]:
                    largest[dim] = size
            elements += tensor.numel()
        self.elements = elements
        if elements <= self.largest_elements:
            return False
        self.largest_elements, self.largest_step = elements, step
        return True

    def _count_length(self, length: int | None) -> None:
        counts = self.length_counts
        if length is None:
            return
        if length in counts:
            counts[length] += 1
        elif len(counts) < MAX_LENGTHS:
            counts[length] = 1

    def length_of(self, batch: Any) -> int | None:
        """``batch``'s length: its size along the first dimension past the batch's that varied so far.

        Before any such dimension varied: the size of dimension 1 of its first tensor with two or more (a language
        model's tokens). ``None`` for a batch of vectors.
        """
        tensors = [tensor for _, tensor in batch_tensors(batch)]
        for index, (smallest, largest) in enumerate(zip(self._smallest, self._largest, strict=True)):
            for dim in range(1, len(smallest)):
                if smallest[dim] != largest[dim] and index < len(tensors) and tensors[index].dim() > dim:
                    return int(tensors[index].shape[dim])
        return next((int(tensor.shape[1]) for tensor in tensors if tensor.dim() >= 2), None)

    def record(self) -> BatchShapes | None:
        """The run's shapes so far (``None`` before any batch with a tensor)."""
        if self.largest_step is None:
            return None
        tensors = tuple(
            TensorShapes(path_name(path), tuple(smallest), tuple(largest))
            for path, smallest, largest in zip(self._paths, self._smallest, self._largest, strict=True)
        )
        return BatchShapes(
            tensors, self.largest_step, self.largest_elements, length_counts=tuple(sorted(self.length_counts.items()))
        )
