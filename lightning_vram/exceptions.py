"""The warning category of the monitor, so users can filter it, the names its warnings begin with, and :func:`warn`."""

import sys
import warnings
from pathlib import Path

MONITOR = "VramMonitor"
"""The name a run's warnings begin with when the Lightning callback measures it: the object its user made."""
SESSION = "VramSession"
"""The name a run's warnings begin with when a :class:`~lightning_vram.VramSession` the user made measures it."""


class VramMonitorWarning(UserWarning):
    """Something could not be measured; training goes on and the report says what is missing."""


def _library_roots() -> tuple[str, ...]:
    """The folders of this package and of the libraries that call its hooks (Lightning, torch), as path prefixes."""
    roots = [str(Path(__file__).resolve().parent)]
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "torch"):
        module = sys.modules.get(name)
        location = getattr(module, "__file__", None)
        if location is not None:
            roots.append(str(Path(location).resolve().parent))
    return tuple(root + "/" for root in roots)


def warn(message: str) -> None:
    """Warn ``message`` as a :class:`VramMonitorWarning` at the user's line, wherever in the monitor it arose.

    The user's line is the first caller outside this package, Lightning and torch (the ``fit`` call, or the session
    method called). A fixed ``stacklevel`` pointed elsewhere for each way in (a callback hook under Lightning's
    loop, a session method called at a script's top level, where it ran past the stack and Python named the place
    ``sys:1``).
    """
    roots = _library_roots()
    frame = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel naming this function's caller
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(roots):
        frame = frame.f_back
        level += 1
    warnings.warn(message, VramMonitorWarning, stacklevel=level)
