"""The replay's batch (a fake copy, see ``twin.fake_batch``) resized or moved for a change."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def resize_batch(batch: Any, old_size: int, new_size: int) -> Any:
    """The fake batch with every tensor whose first dimension is ``old_size`` resized to ``new_size``; in the mode."""

    def resize(tensor: Tensor) -> Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != old_size:
            return tensor
        return torch.empty((new_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)

    return apply_to_collection(batch, Tensor, resize)


def move_batch(batch: Any, device: torch.device) -> Any:
    """The (fake) batch with every tensor on ``device``; call it inside the fake mode."""
    return apply_to_collection(batch, Tensor, lambda tensor: tensor.to(device))
