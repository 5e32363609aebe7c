"""Which out-of-place activation modules have their input read again after they return: inplace would change it.

An activation made inplace overwrites its input with its result. Where the caller reads that input again, as a
residual connection does (``self.fc2(self.act(h)) + h``), it then reads the activation's result instead: the model
computes something else, and autograd raises nothing (the addition saves no tensor). The replay without a change
watches every module with an ``inplace`` flag that is off: the storage of the first tensor it is given, and every op
of the forward pass after the call returns that reads it (another activation given the same input included; the ops
of the module's own call are not such reads). A module whose input is read so is named by :meth:`LaterReads.names`;
a replay that makes it inplace is refused (:func:`read_later_reason`). A later read of a view of the same storage counts
where it may share an element with the input (:func:`may_overlap`: the other half of a tensor sliced in two does not).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from lightning_vram.measure._recompute import running_backward
from lightning_vram.measure.storages import storage_identity
from lightning_vram.measure.tensors import iter_tensors, op_tensors

Extent = tuple[int, tuple[int, ...], tuple[int, ...]]
"""Where a tensor's elements lie in its storage: its offset, shape and strides."""


def _extent(tensor: Tensor) -> Extent:
    return int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride())


def may_overlap(first: Extent, second: Extent) -> bool:
    """Whether two views of one storage may share an element; ``False`` only where they cannot.

    Views of the same strides (the halves of a tensor sliced along a dimension) are told apart by the box each
    covers, the offsets' difference taken apart by the strides where each stride passes every element the smaller
    ones reach (slices of a contiguous tensor); anything else may overlap.

    >>> half = ((4, 2), (8, 1))  # h[:, :2] and h[:, 2:] of a 4x8 tensor, and h[:, 1:3]
    >>> may_overlap((0, *half), (2, *half)), may_overlap((0, *half), (1, *half))
    (False, True)
    >>> may_overlap((0, (4, 2), (8, 1)), (8, (4, 2), (8, 1)))  # rows 0-3 and rows 1-4
    True
    """
    (offset, shape, stride), (other_offset, other_shape, other_stride) = first, second
    if stride != other_stride or len(shape) != len(other_shape) or 0 in shape or 0 in other_shape:
        return stride != other_stride or len(shape) != len(other_shape)
    if offset > other_offset:
        (offset, shape), (other_offset, other_shape) = (other_offset, other_shape), (offset, shape)
    order = sorted(range(len(stride)), key=lambda dim: stride[dim])
    reach = 0  # the farthest element the smaller strides reach, either view: a larger stride must pass it
    for index in order:
        if stride[index] == 0 or stride[index] <= reach:
            return True
        reach += (max(shape[index], other_shape[index]) - 1) * stride[index]
    difference = other_offset - offset
    shifts = [0] * len(stride)
    for index in reversed(order):
        shifts[index], difference = divmod(difference, stride[index])
    if difference:
        return True
    return all(shift < size for shift, size in zip(shifts, shape, strict=True))


def _storage(tensor: Tensor) -> tuple[int, StorageWeakRef] | None:
    """The identity of ``tensor``'s storage and a weak reference to it, or ``None`` without one (sparse, empty)."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    if not storage.nbytes():
        return None
    return storage_identity(storage), StorageWeakRef(storage)  # type: ignore[no-untyped-call]


class LaterReads:
    """Which out-of-place activation modules of ``root`` have their input read by an op after they return.

    Enter it around a replay's step; hand each op to :meth:`on_op`.
    """

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        self._handles: list[RemovableHandle] = []
        # input storage -> (reference, [(where the input lies in it, the module ids given it)])
        self._watched: dict[int, tuple[StorageWeakRef, list[tuple[Extent, set[int]]]]] = {}
        self._calls: list[tuple[int, Extent] | None] = []  # the input of each watched call in progress
        self._read: set[int] = set()

    def __enter__(self) -> LaterReads:
        for module in self._root.modules():
            if vars(module).get("inplace") is not False or isinstance(module, torch.jit.ScriptModule):
                continue
            self._handles.append(module.register_forward_pre_hook(self._entered))
            self._handles.append(module.register_forward_hook(self._returned))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()
        self._calls.clear()

    def _entered(self, _module: nn.Module, args: Any) -> None:
        first = next(iter_tensors(args), None) if not running_backward(default=False) else None
        found = _storage(first) if first is not None else None
        if found is None or first is None:
            self._calls.append(None)
            return
        self._calls.append((found[0], _extent(first)))
        if found[0] not in self._watched:
            self._watched[found[0]] = (found[1], [])

    def _returned(self, module: nn.Module, _args: Any, _output: Any) -> None:
        # Only now is the module noted as having read the storage: the ops of its own call are not later reads.
        if not self._calls:
            return
        call = self._calls.pop()
        if call is None or call[0] not in self._watched:
            return
        inputs = self._watched[call[0]][1]
        for extent, modules in inputs:
            if extent == call[1]:
                modules.add(id(module))
                return
        inputs.append((call[1], {id(module)}))

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _output: Any) -> None:
        """An op ran with ``args`` and ``kwargs``: note the watched modules whose returned input it reads.

        A view op (``slice``, ``view``, ``transpose``) reads no element: the ops given its view do, where they
        overlap the input.
        """
        if not self._watched or getattr(func, "is_view", False) or running_backward(default=False):
            return
        for tensor in op_tensors((args, kwargs)):
            found = _storage(tensor)
            if found is None:
                continue
            watched = self._watched.get(found[0])
            if watched is None:
                continue
            reference, inputs = watched
            if reference.expired():  # type: ignore[no-untyped-call]  # a new storage at a freed one's address
                del self._watched[found[0]]
                continue
            read = _extent(tensor)
            for extent, modules in inputs:
                if may_overlap(extent, read):
                    self._read |= modules

    def names(self) -> frozenset[str]:
        """The modules whose input an op read after they returned it, by every path each has in ``root``."""
        return frozenset(
            name for name, module in self._root.named_modules(remove_duplicate=False) if id(module) in self._read
        )


def read_later_reason(modules: Iterable[str], read_later: frozenset[str]) -> str | None:
    """Why making ``modules`` inplace would change what the model computes, or ``None`` where it would not."""
    read = [name for name in modules if name in read_later]
    if not read:
        return None
    return (
        f"the input of {', '.join(f'`{name}`' for name in read[:5])} is read again after the activation returns (a"
        " residual connection): inplace would overwrite it with the activation's result, and the model would compute"
        " something else"
    )
