"""One guard for the monitor's own code: a part that fails warns once, is switched off, and is reported.

The monitor runs inside the user's training. An error raised by its own code (a probe read, the tracker,
attribution, logging, writing files) must never stop that training: every part of the session calls its work
through :meth:`Guard.call`, which catches it, warns once naming the part, disables the part for the rest of the
run, and lists it in the report's ``not_measured``. Errors of the user's own code never pass through a guarded
call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from lightning_vram.exceptions import SESSION, warn
from lightning_vram.records import NotMeasured

T = TypeVar("T")


class Part(str, Enum):
    """A part of the monitor that can fail on its own; the value is how the report names it."""

    ALLOCATOR = "allocator readings"
    UTILIZATION = "GPU utilization and host memory"
    TRACKER = "phase peaks"
    SHAPES = "batch shapes"
    ATTRIBUTION = "tensor-by-tensor attribution"
    TIMING = "step timing"
    SCALARS = "logged scalars"
    REPORT = "the report"
    FILES = "report files"
    CONSOLE = "console summary"
    OOM = "out-of-memory diagnosis"
    HISTORY = "allocator history"
    STATE = "checkpoint state"
    REPLAY = "step replay"
    PROBE = "the device probe"
    RANKS = "the exchange between ranks"


@dataclass(frozen=True)
class Output:
    """A part named at run time: one publisher (one logger) of the run. ``value`` is how the report names it."""

    value: str


Key = Part | Output
"""What the guard switches off on its own: a fixed part, or one output."""


class Guard:
    """Which parts failed, and why. ``enabled(part)`` is a set lookup, cheap enough for every step.

    ``owner``: the object the user made, which the run's warnings begin with (``"VramSession"``, ``"VramMonitor"``).
    """

    def __init__(self, owner: str = SESSION) -> None:
        self.owner = owner
        self._failed: dict[Key, NotMeasured] = {}
        self.off: Mapping[Key, NotMeasured] = self._failed
        """The failed parts, live (read only): the hot path tests ``part not in guard.off`` inline, runs the part in
        its own ``try`` and hands what it raises to :meth:`fail`, a call fewer than :meth:`call` per part."""

    def enabled(self, part: Key) -> bool:
        """Whether ``part`` still runs."""
        return part not in self._failed

    def call(self, part: Key, function: Callable[..., T], *args: Any) -> T | None:
        """``function(*args)`` run as ``part``; ``None`` when the part is off or fails now (it warns once).

        The one guard every part of the monitor goes through: ``enabled(part)`` tells afterwards whether it ran.
        """
        if part in self._failed:
            return None
        try:
            return function(*args)
        except Exception as error:  # noqa: BLE001 -- the guard: the monitor's own failure must not stop training
            self.fail(part, error)
            return None

    def fail(self, part: Key, error: BaseException) -> None:
        """``part`` raised ``error``: warn (once per part) and switch the part off for the rest of the run."""
        if part in self._failed:
            return
        reason = f"failed with {type(error).__name__}: {error}"
        self._failed[part] = NotMeasured(part.value, f"{reason}; off for the rest of the run")
        warn(
            f"{self.owner}: {part.value} {reason}. It is off for the rest of the run; training goes on and the"
            " report lists it under not_measured."
        )

    @property
    def not_measured(self) -> tuple[NotMeasured, ...]:
        """The failed parts, in the order they failed."""
        return tuple(self._failed.values())
