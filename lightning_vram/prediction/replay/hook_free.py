"""The twin's deep copy without the user's copy hooks: ``deepcopy`` as if the user's classes defined none.

``copy.deepcopy`` calls an object's ``__deepcopy__``, ``__reduce_ex__``, ``__reduce__``, ``__getstate__``,
``__getnewargs_ex__`` and ``__getnewargs__`` on the real object, and ``__setstate__`` on its copy. The user's may
change the real object (a ``__getstate__`` that pops a cache from ``self.__dict__``) or the process (a
``__setstate__`` that registers the copy in a global list, a ``__deepcopy__`` that counts copies on its class), and
the walk that contains the replay only follows what the step's code reads: nothing put those back.

While :func:`without_user_hooks` is on (in this thread and context), an object whose class's hooks, looked up as
Python does (first in the MRO), include one defined in the user's code
(:func:`~lightning_vram.prediction.containment.user_code.is_user_function`) is copied as ``deepcopy`` would copy it
if the user's classes defined none: a new object from the nearest library ``__new__``; its state from the nearest
library ``__getstate__`` (a LightningModule's leaves the Trainer out) or else its ``__dict__`` and slots, read
directly; that state deep-copied and set through the nearest library ``__setstate__`` (``nn.Module``'s) or else
straight into the copy's ``__dict__`` and slots; a ``list`` or ``dict`` subclass's items through ``list``'s and
``dict``'s own methods. Library classes keep their hooks (a Parameter's, a Module's, a tensor's), as do the user's
classes that define none. Where that copy cannot be made (a ``tuple`` or tensor subclass of the user's, a library
base with its own ``__reduce__``, state its ``__getstate__`` left out because it does not copy: a lock, an open
file), the replay is refused, naming the class and its hook (:class:`HookedCopyError`).

Each ``functools.lru_cache`` the copies reach, at any depth (an attribute, a dict's value, a namespace's), is copied
as a fresh, empty one (:func:`_fresh_cache`), never shared with the user's.

``copy.deepcopy`` looks an object's class up in ``copy._deepcopy_dispatch`` before anything else: that dict is
replaced, while any replay copies, by one that answers for those classes (:class:`_Dispatch`), and put back after.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import types
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from lightning_vram.prediction.containment.plain_reads import dict_items, instance_dict
from lightning_vram.prediction.containment.reach import fresh_cache
from lightning_vram.prediction.containment.user_code import is_user_function

COPY_HOOKS = (
    "__deepcopy__",
    "__reduce_ex__",
    "__reduce__",
    "__getstate__",
    "__setstate__",
    "__getnewargs_ex__",
    "__getnewargs__",
)
"""The methods ``copy.deepcopy`` calls on an object or its copy (``__copy__`` is ``copy.copy``'s only)."""

_HEAP_TYPE = 1 << 9
"""``Py_TPFLAGS_HEAPTYPE``: a class made by a ``class`` statement, not one of C's static types."""

_DEFAULT_REDUCERS = frozenset({id(object.__reduce_ex__), id(object.__reduce__)})


class HookedCopyError(Exception):
    """An object of the user's class with copy hooks that the replay cannot copy without them (says which)."""


_ACTIVE: ContextVar[dict[type, str | None] | None] = ContextVar("lightning_vram_hook_free_copy", default=None)
"""While on: each class met, with the user's copy hook it defines (``None``: none, copied as ``deepcopy`` does)."""


def _resolved(cls: type, name: str, user: bool | None = None) -> Any:
    """``name`` as ``cls`` resolves it (the first in its MRO); with ``user=False``, the first not the user's."""
    for klass in cls.__mro__:
        if name in vars(klass):
            attribute = vars(klass)[name]
            if user is False and _is_users(attribute):
                continue
            return attribute
    return None


def _is_users(attribute: Any) -> bool:
    """Whether a class attribute is a function (static or class method, wrapped or not) from the user's code."""
    if isinstance(attribute, (staticmethod, classmethod)):
        attribute = attribute.__func__
    for _ in range(8):  # a chain of decorators, never a cycle
        if isinstance(attribute, types.FunctionType):
            return is_user_function(attribute)
        attribute = getattr(attribute, "__wrapped__", None)
    return False


def user_hook(cls: type) -> str | None:
    """The first of :data:`COPY_HOOKS` that ``cls`` resolves to a function of the user's code, or ``None``."""
    if not cls.__flags__ & _HEAP_TYPE:
        return None
    return next((name for name in COPY_HOOKS if _is_users(_resolved(cls, name))), None)


def _builtin_base(cls: type) -> type:
    """The first class of ``cls``'s MRO that is one of C's static types (``object``, ``dict``, ``list``...)."""
    return next(klass for klass in cls.__mro__ if not klass.__flags__ & _HEAP_TYPE)


def _callable(attribute: Any) -> Any:
    """A class attribute as a plain callable taking the instance (or the class, for ``__new__``) first."""
    return attribute.__func__ if isinstance(attribute, staticmethod) else attribute


def _slots(cls: type) -> dict[str, Any]:
    """The member descriptors of the slots of ``cls`` and its bases, by mangled name (``__x`` of ``A``: ``_A__x``)."""
    descriptors: dict[str, Any] = {}
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            private = name.startswith("__") and not name.endswith("__")
            mangled = f"_{klass.__name__.lstrip('_')}{name}" if private else name
            if mangled not in ("__dict__", "__weakref__") and mangled in vars(klass):
                descriptors.setdefault(mangled, vars(klass)[mangled])
    return descriptors


def _default_state(value: Any) -> Any:
    """``object.__getstate__``'s answer, read without running the object's code: its dict, or (dict, slots)."""
    attributes = instance_dict(value)
    state = attributes if attributes else None
    slots: dict[str, Any] = {}
    for name, descriptor in _slots(type(value)).items():
        with contextlib.suppress(AttributeError):  # a slot never set
            slots[name] = descriptor.__get__(value, type(value))
    return (state, slots) if slots else state


def _set_state(copied: Any, state: Any) -> None:
    """``deepcopy``'s own way of setting a state without ``__setstate__``, past a ``__setattr__`` of the user's."""
    attributes, slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    if attributes is not None:
        target = instance_dict(copied)
        if target is None:
            raise TypeError(f"{type(copied).__qualname__} objects have no __dict__ to set")
        target.update(attributes)
    for name, item in (slots or {}).items():
        object.__setattr__(copied, name, item)


def _copy_without_hooks(value: Any, memo: dict[int, Any], hook: str) -> Any:
    """A deep copy of ``value`` (into ``memo``) made as ``deepcopy`` would if the user's classes had no copy hooks."""
    cls = type(value)
    where = (
        f"the replay's copy of the module or batch would run the user's {cls.__qualname__}.{hook} (on the real object)"
    )
    base = _builtin_base(cls)
    reducers = (_resolved(cls, "__reduce_ex__", user=False), _resolved(cls, "__reduce__", user=False))
    if base not in (object, dict, list):
        raise HookedCopyError(f"{where}, and the replay copies no {base.__name__} subclass without it")
    if _resolved(cls, "__deepcopy__", user=False) is not None or not {id(r) for r in reducers} <= _DEFAULT_REDUCERS:
        raise HookedCopyError(f"{where}, and the replay cannot copy it without it (a library base copies it its way)")
    try:
        copied = _callable(_resolved(cls, "__new__", user=False))(cls)
        memo[id(value)] = copied
        getstate = _resolved(cls, "__getstate__", user=False)
        own_state = getstate is None or getstate is getattr(object, "__getstate__", None)
        state = _default_state(value) if own_state else getstate(value)
        if state is not None:
            state = copy.deepcopy(state, memo)
            setstate = _resolved(cls, "__setstate__", user=False)
            if setstate is not None:
                setstate(copied, state)
            else:
                _set_state(copied, state)
        if base is list:
            list.extend(copied, [copy.deepcopy(item, memo) for item in list.__iter__(value)])
        elif base is dict:
            for key, item in dict_items(value):
                dict.__setitem__(copied, copy.deepcopy(key, memo), copy.deepcopy(item, memo))
    except (TypeError, copy.Error) as error:  # what the hook left out does not copy (a lock, an open file)
        raise HookedCopyError(f"{where}, and its state does not copy without it: {error}") from error
    return copied


def _fresh_cache(cache: Any, memo: dict[int, Any]) -> Any:
    """A ``functools.lru_cache`` copied as a new, empty one of the same function and settings.

    ``deepcopy`` shares a cache (its ``__deepcopy__`` returns it): the replay's copy would call the user's own one,
    count its hits and fill it with fake tensors. A method bound to an object the copy has copied already (the
    module, a submodule: ``memo``) is bound to that object's copy; any other function is the same one (the walk of
    the copy reaches what it holds, as before).
    """
    function = cache.__wrapped__
    if isinstance(function, types.MethodType) and id(function.__self__) in memo:
        function = types.MethodType(function.__func__, memo[id(function.__self__)])
    return fresh_cache(cache, function)


class _Dispatch(dict):  # type: ignore[type-arg]  # copy's own table: classes to copier functions
    """``copy._deepcopy_dispatch`` while a replay copies: the same entries, and copiers of its own.

    One for hooked user classes, one for ``functools.lru_cache`` functions (:func:`_fresh_cache`).
    """

    def get(self, cls: Any, default: Any = None) -> Any:
        found = dict.get(self, cls, default)
        met = _ACTIVE.get()
        if found is None and met is not None and cls is functools._lru_cache_wrapper:
            return _fresh_cache
        if found is not None or met is None or not isinstance(cls, type) or issubclass(cls, type):
            return found  # a class (of a metaclass with hooks) is copied as itself, as deepcopy does
        if cls not in met:
            met[cls] = user_hook(cls)
        hook = met[cls]
        if hook is None:
            return found
        return lambda value, memo: _copy_without_hooks(value, memo, hook)


_LOCK = threading.Lock()
_installed: list[tuple[dict[Any, Any], _Dispatch]] = []
"""The table ``copy`` had and the one put in its place, once per replay copying now (nested or in threads)."""


@contextlib.contextmanager
def without_user_hooks() -> Iterator[None]:
    """``copy.deepcopy`` in this thread and context copies the user's hooked classes without their hooks."""
    with _LOCK:
        original = _installed[0][0] if _installed else copy._deepcopy_dispatch  # type: ignore[attr-defined]
        dispatch = _installed[0][1] if _installed else _Dispatch(original)
        _installed.append((original, dispatch))
        copy._deepcopy_dispatch = dispatch  # type: ignore[attr-defined]
    token = _ACTIVE.set({})
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        with _LOCK:
            _installed.pop()
            if not _installed:
                copy._deepcopy_dispatch = original  # type: ignore[attr-defined]
