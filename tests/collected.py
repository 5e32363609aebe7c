"""What this session's collection saw, kept for tests/test_suite.py (tests/conftest.py records it).

A test of the collection reads it where the session collected every test file, rather than collect the whole suite
again in a process of its own (13 s of a worker's time).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Collection:
    """``modules``: the names in ``sys.modules`` once every test module was imported; ``files``: each collected test
    file's name, in the order the run hands them out, and whether any of its tests starts processes; ``items``: the
    tests collected (before ``-m`` deselects any); ``paths``: every test file collected."""

    modules: frozenset[str]
    files: tuple[tuple[str, bool], ...]
    items: int
    paths: frozenset[str]


COLLECTED = pytest.StashKey[Collection]()
"""Where tests/conftest.py keeps this session's :class:`Collection` (``config.stash``)."""
