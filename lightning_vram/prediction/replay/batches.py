"""The replay's batch (a fake copy, see ``twin.fake_batch``) resized or moved for a change."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_vram.measure.tensors import batch_size_of, iter_tensors


def resize_batch(batch: Any, old_size: int, new_size: int) -> Any:
    """The fake batch with every tensor whose first dimension is ``old_size`` resized to ``new_size``; in the mode.

    Samples are tiled (then cut), so the values stay ones the real data holds and a step that reads them (a mask)
    takes the branch a real batch of that size would.
    """

    def resize(tensor: Tensor) -> Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != old_size or new_size == old_size:
            return tensor
        repeats = (-(-new_size // old_size), *(1 for _ in tensor.shape[1:]))
        stretched = tensor.repeat(repeats) if new_size > old_size else tensor
        return stretched.narrow(0, 0, new_size).clone()  # its own storage: a narrowed view would keep the tiles

    return apply_to_collection(batch, Tensor, resize)


def batch_length(batch: Any) -> int | None:
    """The batch's length: dimension 1 of its first tensor with two or more (``None``: a batch of vectors)."""
    shape = reference_shape(batch)
    return shape[0] if shape is not None else None


def reference_shape(batch: Any) -> tuple[int, ...] | None:
    """The sizes (elements) past the batch dimension of the batch's first tensor with two or more dimensions.

    ``(3, 224, 224)`` for images batched as ``(B, 3, H, W)``, ``(512,)`` for tokens; ``None``: a batch of vectors.
    """
    tensors = [tensor for tensor in iter_tensors(batch) if tensor.dim() >= 2]
    return tuple(int(size) for size in tensors[0].shape[1:]) if tensors else None


def length_shape(batch: Any, length: int) -> tuple[int, ...] | None:
    """The shape ``max_length=length`` means: each reference size equal to the batch's length set to ``length``.

    ``None``: a batch without a length. Resizing to it (:func:`resize_shape`) sets every dimension past the first
    whose size is the batch's length to ``length`` and leaves every other one as it is.

    >>> length_shape((torch.zeros(2, 16, 16), torch.zeros(2, 8)), 64)
    (64, 64)
    """
    old = reference_shape(batch)
    if old is None:
        return None
    return tuple(length if size == old[0] else size for size in old)


def shape_length(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """The length a batch resized from ``old`` to ``new`` has in the report's peak per length (elements).

    The size along the first dimension that changes (:func:`shape_dimension`), as the run's lengths are read along
    the first dimension that varies; ``new[0]`` where none changes.

    >>> shape_length((3, 64, 64), (3, 96, 80)), shape_length((16,), (16,))
    (96, 16)
    """
    return new[shape_dimension(old, new)]


def shape_dimension(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """The first dimension (past the batch's) that resizing ``old`` to ``new`` changes; ``0`` where none does.

    The dimension a ``max_shape`` row of the report's peak per length is read along: a replayed batch's row is read
    along it too (an image batch ``(B, 3, 64, 64)`` under ``max_shape=(3, 128, 128)``: 64, its height, not 3).

    >>> shape_dimension((3, 64, 64), (3, 96, 80)), shape_dimension((16,), (16,))
    (1, 0)
    """
    return next((dim for dim, (size, before) in enumerate(zip(new, old, strict=True)) if size != before), 0)


def sequences_within(batch: Any, tokens: int) -> int:
    """How many of the batch's sequences a batch of at most ``tokens`` tokens holds: at least one, at most all.

    The batch's sequences are its batch size, each :func:`batch_length` tokens long (one token for a batch of
    vectors); a batch without a batch dimension counts as one sequence.

    >>> sequences_within(torch.zeros(8, 128), tokens=256), sequences_within(torch.zeros(8, 16), tokens=256)
    (2, 8)
    """
    sequences = batch_size_of(batch) or 1
    return max(1, min(sequences, tokens // (batch_length(batch) or 1)))


def resize_length(batch: Any, new_length: int) -> Any:
    """The batch with every dimension past the first whose size is the batch's length set to ``new_length``.

    The special case of :func:`resize_shape` for :func:`length_shape`. A batch without a length comes back as it is.
    """
    shape = length_shape(batch, new_length)
    return batch if shape is None else resize_shape(batch, shape)


def _new_size(tensor_dims: int, dim: int, old: tuple[int, ...], new: tuple[int, ...], size: int) -> int:
    """The new size of a tensor's dimension ``dim`` of ``size`` elements, from the reference's ``old`` -> ``new``.

    ``old`` and ``new`` are the reference tensor's sizes past its batch dimension. Where reference dimensions of the
    same old size get different new sizes, the one at the same place counted from the end wins (an image's
    ``(B, 3, H, W)`` and its mask's ``(B, H, W)``); where none is there, the first. An empty dimension stays empty.
    """
    candidates = [index for index, old_size in enumerate(old) if old_size == size]
    if not candidates or not size:
        return size
    aligned = len(old) - (tensor_dims - dim)  # the reference dimension at the same place from the end
    chosen = aligned if aligned in candidates else candidates[0]
    return new[chosen]


def resize_shape(batch: Any, shape: tuple[int, ...]) -> Any:
    """The batch resized so that its reference tensor (see :func:`reference_shape`) has ``shape`` past its batch size.

    In every tensor, each dimension past the first whose size is one of the reference's old sizes gets that
    dimension's new size (ties: see :func:`_new_size`). Each such tensor is tiled along those dimensions (then cut;
    a smaller size is cut only), so its values stay ones the real data could hold (token ids, a mask of ones,
    pixels) and the replay, which reads a batch's values where the step does, takes the branches a real batch of
    that shape would. Inside the fake mode no memory is allocated; outside it the resized tensors are real (one
    batch's memory). A batch without a reference tensor comes back as it is.

    Raises:
        ValueError: ``shape`` has another number of dimensions than the reference tensor past its batch dimension.
    """
    old = reference_shape(batch)
    if old is None:
        return batch
    if len(shape) != len(old):
        raise ValueError(f"shape {shape} has {len(shape)} dimensions, the batch's {old} has {len(old)}")

    def resize(tensor: Tensor) -> Tensor:
        sizes = [
            size if not dim else _new_size(tensor.dim(), dim, old, shape, size) for dim, size in enumerate(tensor.shape)
        ]
        if sizes == list(tensor.shape):
            return tensor
        repeats = [-(-new // size) if new > size else 1 for size, new in zip(tensor.shape, sizes, strict=True)]
        stretched = tensor.repeat(repeats) if any(repeat > 1 for repeat in repeats) else tensor
        for dim, new in enumerate(sizes):
            if new != tensor.shape[dim]:
                stretched = stretched.narrow(dim, 0, new)
        return stretched.clone(memory_format=torch.contiguous_format)  # its own storage, not the tiles'

    return apply_to_collection(batch, Tensor, resize)


def move_batch(batch: Any, device: torch.device) -> Any:
    """The (fake) batch with every tensor on ``device``; call it inside the fake mode."""
    return apply_to_collection(batch, Tensor, lambda tensor: tensor.to(device))
