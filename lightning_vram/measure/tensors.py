"""Finding the tensors inside nested containers (batches, optimizer state, DeepSpeed's partition lists)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


def without_history(tensor: Tensor) -> Tensor:
    """``tensor``, or an alias of it without its ``grad_fn`` (same storage, same version counter) where it has one.

    What a saved-tensor pack hook returns is held by the autograd node that saved it: the tensor itself (or an object
    holding it) would make a reference cycle through C++ (tensor -> grad_fn -> saved -> tensor) that Python's garbage
    collector cannot free, so a forward pass whose backward never runs (a ``training_step`` returning ``None``, a
    replay stopped half-way) would keep its whole graph, activations included, alive.

    A plain tensor's alias is made with ``__torch_dispatch__`` off: a dispatch mode of the user's (an op counter, a
    ``FlopCounterMode``) spanning the step sees the ops it sees without the monitor, not this ``detach`` too. A
    tensor subclass (a replay's fake tensor) needs its own dispatch: it is detached through it.
    """
    if tensor.grad_fn is None:
        return tensor
    if type(tensor) is Tensor:
        with torch._C._DisableTorchDispatch():
            return tensor.detach()
    return tensor.detach()


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


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the first tensor in a batch (nested containers), or ``None``.

    >>> import torch
    >>> batch_size_of((torch.zeros(8, 3), torch.zeros(8)))
    8
    """
    for tensor in iter_tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def op_tensors(value: Any) -> list[Tensor]:
    """The tensors in an op's ``(args, kwargs)`` or in its output, depth first, in order (as pytree's leaves).

    Called for every op a dispatch mode sees: aten's schemas nest a list of tensors at most, so lists, tuples and
    dicts are walked and nothing else (pytree's general walk cost a replay 13 s of 191 in a profile of the suite).

    >>> a, b = torch.zeros(1), torch.ones(2)
    >>> [tuple(t.shape) for t in op_tensors(((a, [None, b], 3), {"out": a}))]
    [(1,), (2,), (1,)]
    """
    found: list[Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[Tensor]) -> None:
    if isinstance(value, Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple, dict)):
                _collect(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
