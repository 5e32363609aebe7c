"""Finding the tensors inside nested containers (batches, optimizer state, DeepSpeed's partition lists)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor


def iter_tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor inside nested dicts, lists and tuples (an optimizer's state entries).

    >>> import torch
    >>> [tuple(t.shape) for t in iter_tensors({"step": torch.zeros(()), "moments": [torch.zeros(2, 3)]})]
    [(), (2, 3)]
    """
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
