"""Reading an object's contents without running any of its code (a subclass's ``__iter__``, a ``__getattr__``).

The replay's walk and its containment read the user's objects through the built-in types they derive from:
whatever those objects override is never called.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterable
from typing import Any


def contents(value: Any) -> list[Any]:
    """The items of a built-in container, read through the built-in type (a subclass's ``__iter__`` is not run)."""
    bases: tuple[type[Any], ...] = (list, tuple, set, frozenset, collections.deque)
    for base in bases:
        if isinstance(value, base):
            iterate: Callable[[Any], Iterable[Any]] = base.__iter__
            return list(iterate(value))
    return []


def slot_names(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` names of ``cls`` and its bases (``__dict__`` and ``__weakref__`` left out)."""
    names: list[str] = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__", ())
        declared = (declared,) if isinstance(declared, str) else declared
        names += [name for name in declared if name not in ("__dict__", "__weakref__") and name not in names]
    return tuple(names)


def dict_items(value: dict[Any, Any]) -> list[tuple[Any, Any]]:
    """A dict's items, read through ``dict`` itself (a subclass's ``items`` or ``__iter__`` is not run)."""
    return list(dict.items(value))


def instance_dict(value: Any) -> dict[str, Any] | None:
    """An object's own attribute dict, read without running its ``__getattr__`` or ``__getattribute__``."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):
        return None
    return attributes if isinstance(attributes, dict) else None


def key_text(key: Any) -> str:
    """A dict key for a path: shown when it is a plain string or number (never a user's ``__repr__``)."""
    return repr(key) if type(key) in (str, int, float, bool) else f"<{type(key).__name__}>"


def is_numpy_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy array (NumPy is not imported for the question)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def is_numpy_generator(value: Any) -> bool:
    """Whether ``value`` is one of NumPy's random generators (``Generator``, the legacy ``RandomState``)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.random.Generator, numpy.random.RandomState))
