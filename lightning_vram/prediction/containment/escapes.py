"""The check after the replays: no fake tensor of theirs is held by anything they did not create.

Everything a replay creates (its copy of the module, its batch, its tensors) is garbage once it returns. A fake
tensor still alive after a full garbage collection is held by something outside: a cache, a list, an attribute the
user's code wrote to. The user's ``functools.lru_cache`` functions that hold one of them (as a result, in one, or as
an argument) are cleared then (a cache recomputes what it lost; the replay gives the caches it finds fresh ones, so
this is for those it could not find); anything else cannot be undone from here, and :func:`check_no_escape` raises
so that the caller turns replays off. Nothing is noted as a round begins: the caches are looked for only when a fake
tensor is found.

The objects alive when a round begins cannot be its fake tensors: :func:`round_of_replays` freezes them
(``gc.freeze``, where nothing of the process is frozen already), so that the check's collection and scan see only
what the round made, and unfreezes them as it ends, whatever happens. A fake tensor found then is looked for again
with everything in view (a pre-existing object that became garbage holding one is collected only so), before any
cache is cleared.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import types
import weakref
from collections import deque
from collections.abc import Iterator

from lightning_vram.prediction.containment.user_code import is_user_file
from lightning_vram.prediction.replay._fake import FakeTensor, FakeTensorMode

_MODES: weakref.WeakSet[FakeTensorMode] = weakref.WeakSet()
_FROZEN: list[bool] = []
"""Holds ``True`` while the objects alive when the round began are frozen by it (``gc.freeze``)."""
_CACHE_WALK_LIMIT = 100_000
"""The most objects :func:`_holds` visits from one cache; a cache holding more is kept (the check raises where the
fake tensor is still held)."""
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, functools._lru_cache_wrapper, FakeTensor)
"""What :func:`_holds` does not walk into: the cached function, its module and classes (their globals are not the
cache's), another cache an entry holds (clearing this one would not let go of that one's entries; it is walked on
its own), and a fake tensor not of the round (its mode reaches every tensor of that mode). Other tensors are walked:
their Python attributes, as a tensor subclass's inner tensors (``MaskedTensor``'s), may be the round's fake ones."""


class ReplayEscapeError(RuntimeError):
    """A replay's fake tensor is held outside the replay and could not be removed."""


@functools.cache
def _every_cache_is_a_referrer_of_its_type() -> bool:
    """Whether ``gc.get_referrers`` of the ``functools.lru_cache`` wrapper type finds every wrapper (asked once).

    It does where a wrapper's garbage-collector traversal visits its type, as a heap type's ``tp_traverse`` must.
    """
    probe = functools.lru_cache(maxsize=1)(lambda: None)
    return any(item is probe for item in gc.get_referrers(functools._lru_cache_wrapper))


def _user_caches() -> list[functools._lru_cache_wrapper[object]]:
    """Every ``functools.lru_cache`` of the user's code (its wrapped function is the user's).

    The collector's objects that refer to the wrapper type, where each wrapper does (half the CPU time of a scan of
    ``gc.get_objects()``: 0.036 s against 0.074 s among the 425,000 objects of a process with transformers and
    Lightning imported); the scan elsewhere. Either sees the same objects: the collector's generations, not what
    ``gc.freeze`` holds.
    """
    candidates = (
        gc.get_referrers(functools._lru_cache_wrapper) if _every_cache_is_a_referrer_of_its_type() else gc.get_objects()
    )
    return [
        item
        for item in candidates
        if type(item) is functools._lru_cache_wrapper
        and isinstance(getattr(item, "__wrapped__", None), types.FunctionType)
        and is_user_file(item.__wrapped__.__code__.co_filename)
    ]


def register(mode: FakeTensorMode) -> None:
    """Watch ``mode``'s fake tensors in the next :func:`check_no_escape`."""
    _MODES.add(mode)


def _unfreeze() -> None:
    """Put the objects the round froze back under the collector (nothing where it froze none)."""
    if _FROZEN:
        _FROZEN.clear()
        gc.unfreeze()


def forget() -> None:
    """End a round of replays without checking (it raised: replays are turned off anyway)."""
    _unfreeze()
    _MODES.clear()


def _escaped() -> list[FakeTensor]:
    if not _MODES:
        return []
    gc.collect()
    found = (item for item in gc.get_objects() if issubclass(type(item), FakeTensor))  # type(): never a __class__
    return [item for item in found if item.fake_mode in _MODES]


def _holds(cache: functools._lru_cache_wrapper[object], tensors: set[int]) -> bool:
    """Whether ``cache`` holds one of ``tensors`` (their ``id``), as an argument or in a result, however deep.

    An entry is held by a link object the garbage collector does not track, so ``gc.get_referrers`` of a tensor
    never names its cache; the cache's own traversal (``gc.get_referents``) visits every entry's key and result. The
    walk stops at :data:`_NOT_WALKED`, and skips what the collector does not track (strings,
    numbers, containers of them only: none can hold a tensor). Past :data:`_CACHE_WALK_LIMIT` objects the cache is
    taken to hold none: clearing a cache is seen (its function runs again, maybe drawing random numbers, and gives
    new objects), so only one found to hold a fake tensor is cleared.
    """
    seen: set[int] = set()
    pending = deque(gc.get_referents(cache))
    while pending:
        item = pending.popleft()
        if id(item) in tensors:
            return True
        if id(item) in seen or not gc.is_tracked(item) or issubclass(type(item), _NOT_WALKED):
            continue  # type(): never a __class__ of the user's (a lazy proxy's resolves its target)
        if len(seen) >= _CACHE_WALK_LIMIT:
            return False
        seen.add(id(item))
        pending.extend(gc.get_referents(item))
    return False


def _holders(tensor: FakeTensor) -> str:
    return ", ".join(sorted({type(item).__name__ for item in gc.get_referrers(tensor)}))


def check_no_escape() -> None:
    """Raise :class:`ReplayEscapeError` if a fake tensor of a replay since the last check is still held somewhere.

    Fake tensors in a ``functools.lru_cache`` of the user's are removed by clearing that cache first. Costs a
    collection and a scan of what the round made, where the round froze what came before it
    (:func:`round_of_replays`); else, and where a fake tensor is found, one full garbage collection, two scans of the
    collector's objects (about 0.3 s in a process that imported transformers) and a walk of each of the user's caches.
    """
    try:
        escaped = _escaped()
        if escaped and _FROZEN:  # look again with every object in view: a frozen one may hold it as garbage
            del escaped
            _unfreeze()
            escaped = _escaped()
        if escaped:
            held = {id(tensor) for tensor in escaped}
            for cache in _user_caches():
                if _holds(cache, held):
                    cache.cache_clear()
            del escaped, held
            escaped = _escaped()
        if escaped:
            raise ReplayEscapeError(
                f"{len(escaped)} fake tensor(s) of the replay are still held outside it (by {_holders(escaped[0])}):"
                " the user's code stored them where the replay cannot take them back"
            )
    finally:
        forget()


@contextlib.contextmanager
def round_of_replays() -> Iterator[None]:
    """Replays run in the body; when it ends normally, :func:`check_no_escape` (an error passes through unchecked).

    As it begins, every object alive is frozen (unless the process has frozen some itself: their freezing is left as
    it is); unfrozen as it ends, whatever happens.
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        _FROZEN.append(True)
    try:
        yield
    except BaseException:
        forget()
        raise
    check_no_escape()
