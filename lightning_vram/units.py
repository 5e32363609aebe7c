"""Byte and fraction formatting for people (binary units, said so)."""

from __future__ import annotations

MIB = 1024**2
"""One mebibyte, in bytes."""
GIB = 1024**3
"""One gibibyte, in bytes."""
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


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


def format_percent(fraction: float | None) -> str:
    """Render a fraction in [0, 1] as a percent, or ``n/a``.

    >>> format_percent(0.034)
    '3.4%'
    """
    if fraction is None:
        return "n/a"
    return f"{100 * fraction:.1f}%"
