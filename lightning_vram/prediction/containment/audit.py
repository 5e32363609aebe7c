"""What a replay does to the world beyond the process, refused as it happens: a Python audit hook (PEP 578).

The walk (:mod:`~.reach`) refuses a step whose own code names ``open``, ``shutil`` or ``subprocess``, but a library
the step calls writes where the walk never looks (``Path.open("a")``, ``Path.write_text``, ``np.savetxt``,
``json.dump`` into a file a helper opened, ``os.remove``). CPython raises an audit event before each such operation
(``open`` with its flags, ``os.remove``, ``subprocess.Popen``, ``socket.connect``: :data:`REFUSED`), whoever calls it.
One hook, added to the process at the first replay (:func:`audit_refusal`; a hook cannot be removed), refuses those
events while a replay runs the user's code on this thread (:func:`refusing_outside_effects`): it raises
:class:`OutsideEffectError` before the file is opened, so nothing is written, and records the call, so that a step
which catches the error is refused all the same (:attr:`OutsideEffects.reason`); a second refused call stops the
replay past the step's ``except Exception`` (:class:`OutsideEffectsRepeated`: a retry loop would never end). Reading
stays allowed (libraries read sources and configurations during a replay), and so does the import system's bytecode
cache (a library a replay imports for the first time writes its ``.pyc``, as training would have).

Every other audit event of the process (imports, ``compile``, ``id()``) and every event of another thread costs the
hook one thread-local read. What no audit event announces is not caught: a write to a file or a descriptor opened
before the step (``os.write``, a logger's stream, a ``csv.writer`` held in a global), a thread started by a library,
a queue an external tracker's thread sends from. The finalizers the garbage collector calls while a replay runs
(of objects that became garbage before it) are not the step's: they pass (:func:`_collecting`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

PROBE = "lightning_vram.replay.probe"
"""The event :func:`audit_refusal` raises to check that the hook runs (a hook an earlier one refused never does)."""


class OutsideEffectError(PermissionError):
    """A replay's code reached for something outside the process (a file written, a process started), refused."""


class OutsideEffectsRepeated(BaseException):
    """A replay's code tried a refused call again: the replay stops there (it is refused since the first).

    Not an :class:`Exception`, so that the user's ``except Exception`` or ``except PermissionError`` around a retry
    loop (a lock file written until it opens) does not keep the replay retrying for ever: no torch op runs in such a
    loop, so the replay's deadline never sees it.
    """


_WRITE_FLAGS = {
    "O_WRONLY": os.O_WRONLY,
    "O_RDWR": os.O_RDWR,
    "O_APPEND": os.O_APPEND,
    "O_CREAT": os.O_CREAT,
    "O_TRUNC": os.O_TRUNC,
}
"""The ``open`` flags that change a file (``O_RDONLY`` is 0: a read sets none of them)."""

_FILES = "a replay would do it again"

REFUSED: dict[str, tuple[str, str]] = {
    "open": ("writes files", "a replay would write them again"),
    "os.remove": ("removes files", _FILES),
    "os.rename": ("renames files", _FILES),
    "os.mkdir": ("makes directories", _FILES),
    "os.rmdir": ("removes directories", _FILES),
    "os.truncate": ("truncates files", _FILES),
    "os.chmod": ("changes files' modes", _FILES),
    "os.chown": ("changes files' owners", _FILES),
    "os.utime": ("changes files' times", _FILES),
    "os.link": ("makes links", _FILES),
    "os.symlink": ("makes links", _FILES),
    "os.setxattr": ("changes files' attributes", _FILES),
    "os.removexattr": ("changes files' attributes", _FILES),
    "shutil.copyfile": ("copies files", _FILES),
    "shutil.copymode": ("copies files' modes", _FILES),
    "shutil.copystat": ("copies files' attributes", _FILES),
    "shutil.copytree": ("copies directories", _FILES),
    "shutil.move": ("moves files", _FILES),
    "shutil.rmtree": ("removes directories", _FILES),
    "shutil.chown": ("changes files' owners", _FILES),
    "shutil.make_archive": ("writes archives", _FILES),
    "shutil.unpack_archive": ("unpacks archives", _FILES),
    "sqlite3.connect": ("opens a database", _FILES),
    "os.chdir": ("changes the working directory", "a replay would change it again"),
    "subprocess.Popen": ("starts processes", "a replay would start them again"),
    "os.system": ("starts processes", "a replay would start them again"),
    "os.exec": ("replaces the process", "a replay would replace it"),
    "os.posix_spawn": ("starts processes", "a replay would start them again"),
    "os.spawn": ("starts processes", "a replay would start them again"),
    "os.fork": ("forks the process", "a replay would fork it again"),
    "os.forkpty": ("forks the process", "a replay would fork it again"),
    "pty.spawn": ("starts processes", "a replay would start them again"),
    "os.startfile": ("starts processes", "a replay would start them again"),
    "os.kill": ("sends signals", "a replay would send them again"),
    "os.killpg": ("sends signals", "a replay would send them again"),
    "signal.pthread_kill": ("sends signals", "a replay would send them again"),
    "socket.connect": ("connects to other processes or hosts", "a replay would connect again"),
    "socket.bind": ("opens sockets", "a replay would open them again"),
    "socket.sendto": ("sends over the network", "a replay would send again"),
    "socket.sendmsg": ("sends over the network", "a replay would send again"),
    "syslog.syslog": ("writes to the system log", "a replay would write it again"),
    PROBE: ("", ""),
}
"""CPython's audit events (3.11, 3.12) refused while a replay runs: what the step does, and what a replay would."""

_IMPORT_SYSTEM = ("importlib._bootstrap_external>", "importlib/_bootstrap_external.py")
"""The file of the import system's code that writes bytecode caches (frozen, or from source)."""


def _flags(flags: int) -> str:
    return "|".join(name for name, flag in _WRITE_FLAGS.items() if flags & flag) or "O_RDONLY"


def _writes(args: tuple[Any, ...]) -> bool:
    """Whether an ``open`` event's ``(path, mode, flags)`` opens for writing (``mode`` is ``None`` from ``os.open``)."""
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
    return any(flags & flag for flag in _WRITE_FLAGS.values()) or any(char in mode for char in "wax+")


def _shown(event: str, args: tuple[Any, ...]) -> str:
    """The refused call as the user would write it: ``open('/tmp/x/steps.txt', 'a')``, ``os.remove('/tmp/x')``."""
    if event == "open":
        path, mode = args[0], args[1]
        if mode is None:
            return f"os.open({path!r}, {_flags(args[2])})"
        return f"open({path!r}, {mode!r})"
    if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
        return f"{event}({args[1]!r})" if len(args) > 1 else event
    shown = ", ".join(repr(os.fsdecode(arg) if isinstance(arg, bytes) else arg) for arg in args[:2])
    return f"{event}({shown})"


def _by_import_system() -> bool:
    """Whether the audited call comes from the import system's bytecode cache (the hook's caller's caller)."""
    try:
        frame = sys._getframe(3)  # this function, _refused, the hook; then the Python code that made the call
    except ValueError:  # called from no Python code at all
        return False
    return frame.f_code.co_filename.endswith(_IMPORT_SYSTEM)


def _refused(event: str, args: tuple[Any, ...]) -> str | None:
    """The refused call, shown (:func:`_shown`), where ``event`` must not happen in a replay; ``None`` where it may."""
    if event not in REFUSED or (event == "open" and not _writes(args)):
        return None
    if event in ("open", "os.mkdir", "os.rename") and _by_import_system():
        return None
    return _shown(event, args)


class _Watch(threading.local):
    """The refused calls of the replay running on this thread so far; ``None`` while none runs on it."""

    refused: list[tuple[str, str]] | None = None
    paused: list[tuple[str, str]] | None = None
    """:attr:`refused` while the garbage collector runs on this thread (:func:`_collecting`)."""


_WATCH = _Watch()


def _hook(event: str, args: tuple[Any, ...], watch: _Watch = _WATCH, refused: Mapping[str, Any] = REFUSED) -> None:
    """The process's audit hook: for an event never refused (``builtins.id``, thousands a replay), one dict lookup.

    Else, outside a replay on this thread, one thread-local read more.
    """
    if event not in refused:
        return
    calls = watch.refused
    if calls is None:
        return
    call = _refused(event, args)
    if call is not None:
        calls.append((event, call))
        message = f"a replay of the training step may not run {call}"
        if len(calls) > 1:  # the step caught the first refusal and went on to another, or to the same again
            raise OutsideEffectsRepeated(message)
        raise OutsideEffectError(message)


def _collecting(phase: str, info: dict[str, int], watch: _Watch = _WATCH) -> None:
    """Pause the replay's refusals while the garbage collector runs on its thread (a ``gc.callbacks`` entry).

    The finalizers a collection calls are not the step's: objects that became garbage anywhere before, whose
    ``weakref.finalize`` or ``__del__`` removes its own file (an earlier monitor's hand-back file, a closed
    ``TemporaryDirectory``). Refused, they would fail unseen (an unraisable exception) and refuse the replay.
    """
    if phase == "start" and watch.refused is not None:
        watch.paused, watch.refused = watch.refused, None
    elif phase == "stop" and watch.paused is not None:
        watch.refused, watch.paused = watch.paused, None


_LOCK = threading.Lock()
_added: list[bool] = []  # whether the hook was added, and runs: decided once per process


def _outside_dynamo(*functions: Callable[..., None]) -> None:
    """Keep torch.compile from tracing ``functions``, the hook and the collector's callback.

    CPython calls them from inside whatever runs, a compiled function too, whose frame evaluator would then take them
    for frames of the user's (dynamo counted one more frame converted in a monitored run than in one without it).
    """
    skip_code = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip_code is None:  # dynamo not imported yet: load it (a replay's force_eager stance does it anyway)
        with contextlib.suppress(ImportError):
            import torch._dynamo.eval_frame

            skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip_code is not None:
        for function in functions:
            skip_code(function.__code__)


def audit_refusal() -> str | None:
    """Add the hook to the process (once, at the first replay); why no replay may run where it does not run.

    ``sys.addaudithook`` adds nothing, silently, where an earlier hook refuses it: the hook is then checked with an
    event of its own (:data:`PROBE`).
    """
    with _LOCK:
        if not _added:
            _outside_dynamo(_hook, _collecting)
            sys.addaudithook(_hook)
            gc.callbacks.append(_collecting)
            with refusing_outside_effects() as probe, contextlib.suppress(OutsideEffectError):
                sys.audit(PROBE)
            _added.append(bool(probe.calls))
    if _added[0]:
        return None
    return (
        "this process refuses Python audit hooks (sys.addaudithook), through which a replay stops the step's file"
        " writes before they happen: the step is not replayed"
    )


class OutsideEffects:
    """The calls the hook refused while :func:`refusing_outside_effects` ran: ``(event, the call shown)`` each."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    @property
    def reason(self) -> str | None:
        """Why the replay is refused, in the user's terms, from the first refused call; ``None`` when none was."""
        if not self.calls:
            return None
        event, call = self.calls[0]
        does, again = REFUSED[event]
        return f"the step {does} ({call}): {again}, so the step is not replayed (it was stopped before it did)"


@contextlib.contextmanager
def refusing_outside_effects() -> Iterator[OutsideEffects]:
    """Refuse :data:`REFUSED`'s events on this thread while the body runs (the user's code in a replay).

    Other threads' events pass. Call :func:`audit_refusal` first: without the hook nothing is refused.
    """
    effects = OutsideEffects()
    previous = _WATCH.refused
    _WATCH.refused = effects.calls
    try:
        yield effects
    finally:
        _WATCH.refused = previous
