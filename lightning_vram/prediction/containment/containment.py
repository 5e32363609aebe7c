"""What a replay's run of the user's code may change outside its copy, saved before and put back after.

:func:`~.reach.reach_of` lists what the code can reach; :func:`contained` saves each
place's state, gives the code a fresh ``lru_cache`` for each of the user's (so no fake tensor is ever cached where
the real step will read it), makes reachable NumPy arrays read-only, and on exit puts back every place the replay
changed: a global or closure rebound, a list, dict, set or array changed, an object's attributes, a random
generator's state, a tensor held outside the module (fake tensors run in-place ops on a real tensor for real) and
the Python attributes set on it, a function's attributes. A ``ContextVar`` is not saved here: the replay runs in a
copy of the context (:meth:`~lightning_vram.prediction.predictor.Predictor.replay`). What it put back is listed,
for the report.
"""

from __future__ import annotations

import array
import contextlib
import random
import types
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_vram.prediction.containment.plain_reads import (
    contents,
    dict_items,
    instance_dict,
    is_numpy_seed_sequence,
    is_numpy_state,
    seed_sequence_state,
    set_seed_sequence_state,
    slot_names,
)
from lightning_vram.prediction.containment.reach import Reach, Slot, fresh_cache

_MISSING = object()
OUTSIDE_TENSOR_BYTES = 64 * 1024**2
"""The most bytes of tensors held outside the module a replay copies to put back (64 MiB); past it, no replay."""


def _same(saved: Any, now: Any) -> bool:
    """Whether two snapshots hold the very same objects (identity, not equality)."""
    if isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(a is b or _same(a, b) for a, b in zip(saved, now, strict=True))
    if isinstance(saved, tuple) and isinstance(now, tuple):
        return len(saved) == len(now) and all(a is b or _same(a, b) for a, b in zip(saved, now, strict=True))
    return saved is now


class _Saved:
    """One object's state: how to read it, whether it changed, and how to put it back."""

    def __init__(self, target: Any, read: Callable[[], Any], write: Callable[[Any], object], always: bool) -> None:
        self.target = target
        self._read = read
        self._write = write
        self._always = always  # generators and byte buffers: put back unconditionally, not compared
        self.state = read()

    def restore(self) -> bool:
        """Put the state back if it changed; whether it had."""
        if self._always:
            self._write(self.state)
            return False
        if _same(self.state, self._read()):
            return False
        self._write(self.state)
        return True


def _set_list(target: list[Any], items: list[Any]) -> None:
    list.__setitem__(target, slice(None), items)


def _set_deque(target: deque[Any], items: list[Any]) -> None:
    deque.clear(target)
    deque.extend(target, items)


def _set_set(target: set[Any], items: list[Any]) -> None:
    set.clear(target)
    set.update(target, items)


def _set_items(target: dict[Any, Any], items: list[tuple[Any, Any]]) -> None:
    # An OrderedDict keeps its order in a list of its own, which dict's methods do not update: its own, then.
    base: Any = OrderedDict if isinstance(target, OrderedDict) else dict
    base.clear(target)
    base.update(target, items)


def _set_array(target: array.array[Any], state: bytes) -> None:
    del target[:]
    target.frombytes(state)


def _object_state(target: Any, names: tuple[str, ...]) -> list[Any]:
    """An object's attributes: its ``__dict__`` items and its ``__slots__`` values (read without running its code)."""
    attributes = instance_dict(target)
    slots = []
    for name in names:
        try:
            slots.append(object.__getattribute__(target, name))
        except AttributeError:
            slots.append(_MISSING)
    return [dict_items(attributes) if attributes is not None else [], slots]


def _set_object_state(target: Any, names: tuple[str, ...], state: list[Any]) -> None:
    items, slots = state
    attributes = instance_dict(target)
    if attributes is not None:
        _set_items(attributes, items)
    for name, value in zip(names, slots, strict=True):
        if value is _MISSING:
            with contextlib.suppress(AttributeError):
                object.__delattr__(target, name)
        else:
            object.__setattr__(target, name, value)


def _saver(target: Any) -> _Saved | None:
    """How to save and restore ``target``'s state; ``None`` for a kind of object it does not know.

    Containers are read and written through their built-in type, so a subclass's overridden methods never run.
    """
    if isinstance(target, list):
        return _Saved(target, lambda: contents(target), lambda state: _set_list(target, state), False)
    if isinstance(target, deque):
        return _Saved(target, lambda: contents(target), lambda state: _set_deque(target, state), False)
    if isinstance(target, set):
        return _Saved(target, lambda: sorted(contents(target), key=id), lambda state: _set_set(target, state), False)
    if isinstance(target, dict):
        return _Saved(target, lambda: dict_items(target), lambda state: _set_items(target, state), False)
    if isinstance(target, array.array):
        return _Saved(target, target.tobytes, lambda state: _set_array(target, state), True)
    if isinstance(target, bytearray):
        return _Saved(target, lambda: bytes(target), lambda state: target.__setitem__(slice(None), state), True)
    if isinstance(target, random.Random):
        return _Saved(target, target.getstate, target.setstate, True)
    if isinstance(target, torch.Generator):
        return _Saved(target, target.get_state, target.set_state, True)
    if is_numpy_state(target):
        if hasattr(target, "get_state"):  # numpy.random.RandomState
            return _Saved(target, target.get_state, target.set_state, True)
        return _Saved(target, lambda: target.state, lambda state: setattr(target, "state", state), True)
    if is_numpy_seed_sequence(target):  # held by the walk only where its state reads (seed_sequence_state)
        return _Saved(
            target, lambda: seed_sequence_state(target), lambda state: set_seed_sequence_state(target, state), True
        )
    names = slot_names(type(target))
    if instance_dict(target) is not None or names:
        read = lambda: _object_state(target, names)  # noqa: E731 -- a closure over the names, read twice
        return _Saved(target, read, lambda state: _set_object_state(target, names, state), False)
    return None


def _slot_saver(slot: Slot) -> _Saved:
    def read() -> Any:
        try:
            return slot.get()
        except (KeyError, AttributeError, ValueError):
            return _MISSING

    def write(value: Any) -> None:
        if value is not _MISSING:
            slot.set(value)
        elif isinstance(slot.holder, dict):
            slot.holder.pop(slot.key, None)
        elif isinstance(slot.holder, types.CellType):
            with contextlib.suppress(ValueError):
                del slot.holder.cell_contents
        else:
            with contextlib.suppress(AttributeError):
                delattr(slot.holder, slot.key or "")

    return _Saved(slot, read, write, False)


class _TensorSaved:
    """A tensor held outside the module: its version counter and a copy of its values (on its own device, no sync).

    Fake tensors compute in-place ops on a real tensor for real; the copy puts its values back. Read and written with
    a subclass's ``__torch_function__`` off: the user's code (a tensor subclass counting its calls) must not run.
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            self.version = _version(tensor)
            self.copy = tensor.detach().clone()

    def restore(self) -> bool:
        """Whether the tensor changed (and was put back)."""
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            if _version(self.tensor) == self.version:
                return False
            self.tensor.copy_(self.copy)
        return True


def _version(tensor: Tensor) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be changed in place)
        return None


class ContainmentError(RuntimeError):
    """The replay changed something outside its copy that could not be put back."""


class Containment:
    """What :func:`contained` put back after the replay (``restored``: a line for each place)."""

    def __init__(self) -> None:
        self.restored: list[str] = []


def _describe(target: Any, paths: Mapping[int, str]) -> str:
    """A place the replay changed, as a note names it: where the walk found it (``paths``, by id) where known."""
    if isinstance(target, Slot):
        holder = target.holder
        if isinstance(holder, dict):
            return f"the global {target.key!r}"
        if target.key is None:
            return "a closure variable"
        return f"{getattr(holder, '__qualname__', type(holder).__name__)}.{target.key}"
    path = paths.get(id(target))
    if path is not None:
        return f"{path} (a {type(target).__name__})"
    return f"a {type(target).__name__} held outside the module"


@contextlib.contextmanager
def contained(reach: Reach) -> Iterator[Containment]:
    """Save what ``reach`` lists, run the body with fresh caches and read-only arrays, then put back what changed.

    Raises :class:`ContainmentError` after the body when a place refused its saved state back.
    """
    cache_slots = {id(slot) for slot, _cache in reach.caches}
    savers: list[_Saved] = [_slot_saver(slot) for slot in reach.slots]
    savers += [saver for saver in map(_saver, reach.objects) if saver is not None]
    tensors = [_TensorSaved(tensor) for tensor in reach.tensors]
    writeable = [(array, bool(array.flags.writeable)) for array in reach.arrays]
    containment = Containment()
    try:
        for array, _ in writeable:
            array.flags.writeable = False
        for slot, cache in reach.caches:
            slot.set(fresh_cache(cache))
        yield containment
    finally:
        for array, flag in writeable:
            with contextlib.suppress(ValueError):  # a view of a read-only base stays read-only
                array.flags.writeable = flag
        for slot, cache in reach.caches:  # first: a dict, list or object holding a cache did not change otherwise
            with contextlib.suppress(IndexError):  # a list the replay shortened: its saver puts it back whole
                slot.set(cache)
        lost: list[str] = []
        for saver in reversed(savers):
            try:
                if saver.restore() and id(saver.target) not in cache_slots:
                    containment.restored.append(_describe(saver.target, reach.paths))
            except Exception as error:  # noqa: BLE001 -- a state the object refused back: reported below
                lost.append(f"{_describe(saver.target, reach.paths)} ({type(error).__name__}: {error})")
        for saved in tensors:
            if saved.restore():
                containment.restored.append(f"a {tuple(saved.tensor.shape)} tensor held outside the module")
    if lost:
        raise ContainmentError(f"the replay changed what it cannot put back: {'; '.join(lost)}")
