"""Byte and fraction formatting for people (binary units, said so)."""

from __future__ import annotations

import re

MIB = 1024**2
"""One mebibyte, in bytes."""
GIB = 1024**3
"""One gibibyte, in bytes."""
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
"""The units a size may be given in, lower-cased, in bytes: decimal (``GB``, as GPU makers count), binary (``GiB``)."""
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def format_bytes(num_bytes: int | None) -> str:
    """Render a byte count in binary units, or ``n/a`` when it was not measured.

    >>> format_bytes(1536)
    '1.5 KiB'
    >>> format_bytes(3 * 1024**3)
    '3.00 GiB'
    >>> format_bytes(None)
    'n/a'
    """
    if num_bytes is None:
        return "n/a"
    value = float(num_bytes)
    unit = _BINARY_UNITS[0]
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    if unit in ("GiB", "TiB"):
        return f"{value:.2f} {unit}"
    return f"{value:.1f} {unit}"


def parse_size(text: str) -> int | None:
    """``text`` as bytes; ``None`` where it is not a size.

    A size is a number of bytes, or a number and one of :data:`SIZE_UNITS` (any case, spaces allowed); fractions of a
    byte are dropped.

    >>> parse_size("1.5 GiB"), parse_size("80GB"), parse_size("4096"), parse_size("40 G")
    (1610612736, 80000000000, 4096, None)
    """
    match = _SIZE.fullmatch(text)
    unit = SIZE_UNITS.get(match[2].lower()) if match is not None else None
    if match is None or unit is None:
        return None
    return int(float(match[1]) * unit)


def format_percent(fraction: float | None) -> str:
    """Render a fraction in [0, 1] as a percent, or ``n/a``.

    >>> format_percent(0.034)
    '3.4%'
    """
    if fraction is None:
        return "n/a"
    return f"{100 * fraction:.1f}%"
