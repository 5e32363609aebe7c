"""A value set in a module's or a class's namespace for the length of a ``with`` block, as a user installs one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

MISSING = object()
"""The entry a namespace did not have before."""


@contextlib.contextmanager
def installed(holder: Any, name: str, value: Any) -> Iterator[None]:
    """``value`` set as ``holder.name`` (a module's or a class's), its own entry put back after (or removed)."""
    own = vars(holder).get(name, MISSING)
    setattr(holder, name, value)
    try:
        yield
    finally:
        if own is MISSING:
            delattr(holder, name)
        else:
            setattr(holder, name, own)
