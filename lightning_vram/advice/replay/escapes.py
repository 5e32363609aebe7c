"""The check after the replays: no fake tensor of theirs is held by anything they did not create.

Everything a replay creates (its copy of the module, its batch, its tensors) is garbage once it returns. A fake
tensor still alive after a full garbage collection is held by something outside: a cache, a list, an attribute the
user's code wrote to. The user's ``functools.lru_cache`` functions are cleared then (a cache recomputes what it
lost; the replay gives the caches it finds fresh ones, so this is for those it could not find); anything else
cannot be undone from here, and :func:`check_no_escape` raises so that the caller turns replays off.
"""

from __future__ import annotations

import functools
import gc
import types
import weakref

from lightning_vram.advice.replay._fake import FakeTensor, FakeTensorMode
from lightning_vram.measure.user_code import is_user_file

_MODES: weakref.WeakSet[FakeTensorMode] = weakref.WeakSet()


class ReplayEscapeError(RuntimeError):
    """A replay's fake tensor is held outside the replay and could not be removed."""


def register(mode: FakeTensorMode) -> None:
    """Watch ``mode``'s fake tensors in the next :func:`check_no_escape`."""
    _MODES.add(mode)


def _escaped() -> list[FakeTensor]:
    if not _MODES:
        return []
    gc.collect()
    found = (item for item in gc.get_objects() if issubclass(type(item), FakeTensor))  # type(): never a __class__
    return [item for item in found if item.fake_mode in _MODES]


def _user_caches() -> list[functools._lru_cache_wrapper[object]]:
    """Every ``functools.lru_cache`` of the user's code that holds entries.

    An entry's result is held by a link object the garbage collector does not track, so which cache holds a given
    tensor cannot be asked; every non-empty cache of the user's is cleared instead.
    """
    return [
        item
        for item in gc.get_objects()
        if type(item) is functools._lru_cache_wrapper
        and item.cache_info().currsize
        and isinstance(getattr(item, "__wrapped__", None), types.FunctionType)
        and is_user_file(item.__wrapped__.__code__.co_filename)
    ]


def _holders(tensor: FakeTensor) -> str:
    return ", ".join(sorted({type(item).__name__ for item in gc.get_referrers(tensor)}))


def check_no_escape() -> None:
    """Raise :class:`ReplayEscapeError` if a fake tensor of a replay since the last check is still held somewhere.

    Fake tensors in a ``functools.lru_cache`` are removed by clearing that cache first. Costs one full garbage
    collection (about 0.2 s in a process that imported transformers).
    """
    try:
        escaped = _escaped()
        if escaped:
            for cache in _user_caches():
                cache.cache_clear()
            del escaped
            escaped = _escaped()
        if escaped:
            raise ReplayEscapeError(
                f"{len(escaped)} fake tensor(s) of the replay are still held outside it (by {_holders(escaped[0])}):"
                " the user's code stored them where the replay cannot take them back"
            )
    finally:
        _MODES.clear()
