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
    tensors = [tensor for tensor in iter_tensors(batch) if tensor.dim() >= 2]
    return int(tensors[0].shape[1]) if tensors else None


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

    Each such tensor is tiled along those dimensions (then cut), so its values stay ones the real data could hold
    (token ids, a mask of ones) and the replay, which reads a batch's values where the step does, takes the branches
    a real batch of that length would. Inside the fake mode no memory is allocated; outside it the resized tensors
    are real (one batch's memory). A batch without a length comes back as it is.
    """
    old_length = batch_length(batch)
    if old_length is None:
        return batch

    def resize(tensor: Tensor) -> Tensor:
        dims = [dim for dim, size in enumerate(tensor.shape) if dim and size == old_length]
        if not dims or new_length == old_length:
            return tensor
        repeats = [-(-new_length // old_length) if dim in dims else 1 for dim in range(tensor.dim())]
        stretched = tensor.repeat(repeats) if new_length > old_length else tensor
        for dim in dims:
            stretched = stretched.narrow(dim, 0, new_length)
        return stretched.clone(memory_format=torch.contiguous_format)  # its own storage, not the tiles'

    return apply_to_collection(batch, Tensor, resize)


def move_batch(batch: Any, device: torch.device) -> Any:
    """The (fake) batch with every tensor on ``device``; call it inside the fake mode."""
    return apply_to_collection(batch, Tensor, lambda tensor: tensor.to(device))
