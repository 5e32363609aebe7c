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
    """Whether ``value`` is a NumPy ``Generator``: its state is its bit generator's (:func:`numpy_bit_generator`)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.random.Generator)


def is_numpy_state(value: Any) -> bool:
    """Whether ``value`` is a NumPy random object whose whole state its ``state`` (or ``get_state``) holds.

    A bit generator (``PCG64``, ``MT19937``, ...; its seed sequence aside) or the legacy ``RandomState``.
    """
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.random.BitGenerator, numpy.random.RandomState))


def numpy_bit_generator(value: Any) -> Any:
    """The bit generator a NumPy ``Generator`` draws from, read through NumPy's type (a subclass's is not run)."""
    numpy = sys.modules["numpy"]
    return numpy.random.Generator.bit_generator.__get__(value)


def numpy_seed_sequence(value: Any) -> Any:
    """The seed sequence a NumPy bit generator's ``spawn`` advances, read through NumPy's type; else ``None``."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, numpy.random.BitGenerator):
        return None
    return numpy.random.BitGenerator.seed_seq.__get__(value)


def is_numpy_seed_sequence(value: Any) -> bool:
    """Whether ``value`` is a NumPy ``SeedSequence`` (its ``spawn`` counts the children it made)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.random.SeedSequence)


def seed_sequence_state(value: Any) -> tuple[Any, ...] | None:
    """A NumPy ``SeedSequence``'s fields (``n_children_spawned`` among them), as its pickling reads them.

    ``n_children_spawned`` is read-only in Python; the class's Cython pickling reads and writes every field
    (:func:`set_seed_sequence_state`). ``None`` where that pickling has another form: the state cannot be put back.
    """
    seed_sequence = sys.modules["numpy"].random.SeedSequence
    try:
        reduced = seed_sequence.__reduce__(value)
    except (TypeError, ValueError):  # a NumPy whose SeedSequence does not pickle
        return None
    if "__setstate__" in vars(seed_sequence) and isinstance(reduced, tuple) and len(reduced) == 3:
        return reduced[2] if isinstance(reduced[2], tuple) else None
    return None


def set_seed_sequence_state(value: Any, state: tuple[Any, ...]) -> None:
    """Put back what :func:`seed_sequence_state` read."""
    sys.modules["numpy"].random.SeedSequence.__setstate__(value, state)
