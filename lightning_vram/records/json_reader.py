"""Reading JSON the monitor wrote, field by field: :class:`Reader` and the :class:`FormatError` it raises.

Encoding gives plain Python data (dicts, lists, strings, numbers, ``None``), so a checkpoint carrying the monitor's
state loads with ``torch.load(weights_only=True)`` and a report is ``json.dumps``-able. Decoding checks every
field's type and raises :class:`FormatError` naming the field: a report or a checkpoint edited by hand, truncated
or written by something else is refused in one sentence, never half-read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

MAX_INTEGER = 2**63 - 1
"""The largest integer a field may hold: byte counts and steps are int64 in torch, and beyond it floats overflow."""


SHOWN_CHARACTERS = 60
"""How much of a bad value an error message quotes."""


T = TypeVar("T")
E = TypeVar("E", bound=Enum)


class FormatError(ValueError):
    """Data is not what the codec wrote: a field is missing, of the wrong type, or out of range."""


class Reader:
    """Typed access to one JSON object, naming the field (``where.key``) in every error."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise FormatError(f"{where} must be an object, got {kind_of(data)}")
        self._data = data
        self._where = where

    def has(self, key: str) -> bool:
        """Whether the object has the field (fields added in later versions are absent from older files)."""
        return key in self._data

    def added(self, key: str, read: Callable[[Reader, str], T], default: T) -> T:
        """A field a later release added: ``read(self, key)``, or ``default`` where an older file lacks it.

        >>> Reader({"steps": 3}, "report").added("precision", Reader.optional_text, None) is None
        True
        """
        return read(self, key) if key in self._data else default

    def raw(self, key: str) -> Any:
        """The field's value as it is (its type unchecked)."""
        if key not in self._data:
            raise FormatError(f"{self._where}: missing field {key!r}")
        return self._data[key]

    def _path(self, key: str) -> str:
        return member(self._where, key)

    def integer(self, key: str, minimum: int | None = 0) -> int:
        """An integer field (bools refused), at least ``minimum``."""
        return as_int(self.raw(key), self._path(key), minimum)

    def optional_integer(self, key: str, minimum: int | None = 0) -> int | None:
        """An integer field or ``null``."""
        value = self.raw(key)
        return None if value is None else as_int(value, self._path(key), minimum)

    def optional_number(self, key: str, minimum: float | None = 0.0) -> float | None:
        """A finite number or ``null``."""
        value = self.raw(key)
        return None if value is None else _as_float(value, self._path(key), minimum)

    def number(self, key: str, minimum: float | None = 0.0) -> float:
        """A finite number."""
        return _as_float(self.raw(key), self._path(key), minimum)

    def text(self, key: str) -> str:
        """A string field."""
        value = self.raw(key)
        if not isinstance(value, str):
            raise FormatError(f"{self._path(key)} must be a string, got {kind_of(value)}")
        return value

    def optional_text(self, key: str) -> str | None:
        """A string field or ``null``."""
        return None if self.raw(key) is None else self.text(key)

    def optional_flag(self, key: str) -> bool | None:
        """``true``, ``false`` or ``null``."""
        value = self.raw(key)
        if value is not None and not isinstance(value, bool):
            raise FormatError(f"{self._path(key)} must be true, false or null, got {kind_of(value)}")
        return value

    def flag(self, key: str) -> bool:
        """``true`` or ``false``."""
        value = self.optional_flag(key)
        if value is None:
            raise FormatError(f"{self._path(key)} must be true or false, got null")
        return value

    def child(self, key: str) -> Reader:
        """A nested object."""
        return Reader(self.raw(key), self._path(key))

    def optional_child(self, key: str) -> Reader | None:
        """A nested object or ``null``."""
        value = self.raw(key)
        return None if value is None else Reader(value, self._path(key))

    def entries(self, key: str) -> list[tuple[str, Any]]:
        """The entries of a nested object."""
        value = self.raw(key)
        if not isinstance(value, dict):
            raise FormatError(f"{self._path(key)} must be an object, got {kind_of(value)}")
        return list(value.items())

    def texts(self, key: str) -> list[str]:
        """A list of strings."""
        return text_list(self.raw(key), self._path(key))

    def each(self, key: str, decode: Callable[[Any, str], T]) -> list[T]:
        """A list field, each item decoded by ``decode(item, where)``."""
        value = self.raw(key)
        path = self._path(key)
        if not isinstance(value, list):
            raise FormatError(f"{path} must be a list, got {kind_of(value)}")
        return [decode(item, f"{path}[{index}]") for index, item in enumerate(value)]


def kind_of(value: Any) -> str:
    """What a JSON value is, for an error message: ``null`` or its Python type's name."""
    return "null" if value is None else type(value).__name__


def shown(value: Any) -> str:
    """``repr(value)``, shortened to :data:`SHOWN_CHARACTERS`: an error message quotes a bad value, not a file.

    >>> print(shown("x" * 100), shown([1, 2]))
    'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx… a list of length 2
    """
    if isinstance(value, (list, dict)):
        return f"a {kind_of(value)} of length {len(value)}"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 1] + "…"


def member(where: str, key: str) -> str:
    r"""The path of ``key`` in ``where`` for an error message: ``where.key``, or ``where['odd key']``.

    >>> print(member("evaluation", "validation"), member("evaluation", "a.b\nc"))
    evaluation.validation evaluation['a.b\nc']
    """
    if key.isidentifier() and key.isascii():
        return f"{where}.{key}"
    return f"{where}[{shown(key)}]"


def _as_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{where} must be a string, got {kind_of(value)}")
    return value


def text_list(value: Any, where: str) -> list[str]:
    """A list of strings at ``where``."""
    if not isinstance(value, list):
        raise FormatError(f"{where} must be a list, got {kind_of(value)}")
    return [_as_text(item, f"{where}[{index}]") for index, item in enumerate(value)]


def member_of(closed_set: type[E], text: str, where: str) -> E:
    """The member of ``closed_set`` whose value is ``text``.

    >>> from lightning_vram.records.measured import Phase
    >>> member_of(Phase, "backward", "peak.phase")
    <Phase.BACKWARD: 'backward'>
    """
    for member in closed_set:
        if member.value == text:
            return member
    raise FormatError(f"{where} must be one of {[member.value for member in closed_set]}, got {shown(text)}")


def as_int(value: Any, where: str, minimum: int | None) -> int:
    """An integer at ``where`` (bools refused), at least ``minimum`` and at most :data:`MAX_INTEGER`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where} must be an integer, got {kind_of(value)}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {shown(value)}")
    if value > MAX_INTEGER:
        raise FormatError(f"{where} must be at most 2**63 - 1, got {shown(value)}")
    return value


def _as_float(value: Any, where: str, minimum: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FormatError(f"{where} must be a number, got {kind_of(value)}")
    if (isinstance(value, int) and abs(value) > MAX_INTEGER) or not math.isfinite(value):
        raise FormatError(f"{where} must be a finite number, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {shown(value)}")
    return float(value)
