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


def time_major(batch: Any) -> str | None:
    """Why the first dimension of ``batch`` is not its batch dimension, where its tensors show it; else ``None``.

    A time-major batch (``(L, B)`` token ids, as ``pad_sequence`` returns them by default and ``nn.LSTM`` and
    ``nn.Transformer`` take them by default, beside ``(B,)`` labels) starts with its length: another tensor's first
    dimension is one of the first tensor's later ones, not its first. Varying the first dimension there varies the
    length, not the batch. A batch whose every tensor is time-major (a language model's ``(L, B)`` inputs and
    targets) shows nothing of it; a batch-first one carrying an unbatched tensor of its length (``(L,)`` position
    ids, an ``(L, L)`` mask) reads the same, and is not varied either.

    Only a first tensor of two or three dimensions, ``(L, B)`` or ``(L, B, F)``, and its second dimension are read:
    an image batch ``(B, 3, H, W)`` beside a detection target of three boxes, ``(3, 4)``, is batch-first (read at any
    later dimension, it lost the run's batch size whenever an image held 3 boxes).

    >>> import torch
    >>> time_major((torch.zeros(64, 32), torch.zeros(32))).split(":")[0]
    'its first tensor, (64, 32), starts with 64 where another, (32,), starts with 32, its second dimension'
    >>> time_major((torch.zeros(8, 3), torch.zeros(8))) is None, time_major(torch.zeros(3, 3)) is None
    (True, True)
    >>> time_major((torch.zeros(8, 3, 32, 32), [{"boxes": torch.zeros(3, 4)}])) is None
    True
    """
    tensors = [tensor for tensor in iter_tensors(batch) if tensor.dim() > 0]
    if not tensors or tensors[0].dim() not in (2, 3):
        return None
    first = tensors[0]
    size, second = int(first.shape[0]), int(first.shape[1])
    for other in tensors[1:]:
        start = int(other.shape[0])
        if start != size and start == second:
            return (
                f"its first tensor, {tuple(first.shape)}, starts with {size} where another, {tuple(other.shape)},"
                f" starts with {start}, its second dimension: the batch dimension may be there (a time-major batch,"
                " whose first dimension is its length), so varying the first would vary the length, not the batch"
            )
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
