"""What a replay must leave as it found it: process-wide settings and generators; and its output.

The replay runs the user's ``training_step`` on a fake copy, so the user's module, optimizer and gradients are never
touched; the process-wide state below (generators, default dtype, grad mode, threads, environment) is what such
code could still change (what else it reaches is saved and
put back by :mod:`~lightning_vram.prediction.containment.containment`). The replayed code's prints and warnings are not
shown, but only the replaying thread's: other threads keep writing to the same streams and warning as before
(no process-wide redirection, no change to the warnings filters).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import sys
import threading
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any, TextIO

import torch


class _OtherThreadsOnly:
    """A stream that drops what one thread writes and passes everything else to the stream it stands in for."""

    def __init__(self, stream: TextIO, silenced: int) -> None:
        self._stream = stream
        self._silenced = silenced

    def write(self, text: str) -> int:
        if threading.get_ident() == self._silenced:
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _unmark(message: Any, category: type[Warning], filename: str, lineno: int) -> None:
    """Forget that a silenced warning was shown: the run's own first one of it is shown, as without the replay.

    Python marks a warning shown in the warning's module registry (``__warningregistry__``) before it asks
    ``showwarning`` to show it; marks it finds already there mean the warning is not shown again (the default
    filter shows each once per place): a preflight replay, before the run's first step, took that step's first
    warning away from the user. Only marks this warning just made are there to forget: a warning already marked is
    never handed to ``showwarning``. The registry is the one of the frame that
    warned (found on the stack by file and line; none found: nothing to forget).
    """
    text = str(message)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename != filename or frame.f_lineno != lineno):
        frame = frame.f_back
    if frame is None:
        return
    registry = frame.f_globals.get("__warningregistry__")
    action = _action(text, category, str(frame.f_globals.get("__name__", "<string>")), lineno)
    # CPython's warnings (_warnings.c): the place's key, and under "module" and "once" the warning's own key, in
    # the module's registry (the once registry under "once" where the module has none).
    if isinstance(registry, dict):
        registry.pop((text, category, lineno), None)
        if action in ("module", "once"):
            registry.pop((text, category), None)
    elif action == "once":
        getattr(warnings, "onceregistry", {}).pop((text, category), None)  # typeshed leaves it out


def _action(text: str, category: type[Warning], module: str, lineno: int) -> str:
    """The action the warnings filters take for a warning, as :func:`warnings.warn_explicit` finds it."""
    for action, message, kind, place, line in warnings.filters:
        if (
            (message is None or message.match(text))
            and issubclass(category, kind)
            and (place is None or place.match(module))
            and (line == 0 or line == lineno)
        ):
            return str(action)
    return str(getattr(warnings, "defaultaction", "default"))  # typeshed leaves it out


@contextlib.contextmanager
def _quiet_thread() -> Iterator[None]:
    """Silence this thread's prints and warnings; other threads' still reach their streams and handlers."""
    me = threading.get_ident()
    stdout, stderr, showwarning = sys.stdout, sys.stderr, warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() != me:
            showwarning(message, category, filename, lineno, *args, **kwargs)
        else:
            _unmark(message, category, filename, lineno)

    sys.stdout = _OtherThreadsOnly(stdout, me)
    sys.stderr = _OtherThreadsOnly(stderr, me)
    warnings.showwarning = show
    try:
        yield
    finally:
        # Put each back only if nobody replaced it meanwhile (another thread's own redirection stays).
        if isinstance(sys.stdout, _OtherThreadsOnly):
            sys.stdout = stdout
        if isinstance(sys.stderr, _OtherThreadsOnly):
            sys.stderr = stderr
        if warnings.showwarning is show:
            warnings.showwarning = showwarning


def _restore_environment(saved: dict[str, str]) -> None:
    """Make ``os.environ`` (and the process's environment) equal ``saved`` again."""
    for name in [name for name in os.environ if name not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


class _NotFromThread(logging.Filter):
    """Drops the records one thread logs."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self._thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self._thread


ONCE_PER_PROCESS = ("warning_once", "info_once")
"""``logging.Logger`` methods a library (transformers) adds behind a process-wide ``lru_cache``: a message the replay
logged once would never be shown to the user's own step."""


def quieted_handlers() -> dict[int, logging.Handler]:
    """The handlers that drop a replay's log records (:func:`_quiet_logs`), by id: every logger's, and the last resort.

    What a replay logs through them is never written: the walk of the user's code need not save their streams.
    """
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {id(handler): handler for logger in loggers for handler in getattr(logger, "handlers", ())}
    if logging.lastResort is not None:
        handlers[id(logging.lastResort)] = logging.lastResort
    return handlers


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """The replaying thread's log records are dropped by every handler; other threads' pass.

    torch logs an op that fails on fake tensors with its traceback (whose frames would keep the replay's copy alive
    in a handler that keeps records), and a library's messages about the replay's copy are not the user's news.
    Each once-per-process logging method gets a fresh cache for the replay, so the user's step still logs its
    message the first time.
    """
    quiet = _NotFromThread(threading.get_ident())
    handlers = quieted_handlers()
    replaced = {}
    for name in ONCE_PER_PROCESS:
        method = getattr(logging.Logger, name, None)
        if isinstance(method, functools._lru_cache_wrapper):
            replaced[name] = method
            setattr(logging.Logger, name, functools.lru_cache(None)(method.__wrapped__))
    for handler in handlers.values():
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers.values():
            handler.removeFilter(quiet)
        for name, method in replaced.items():
            setattr(logging.Logger, name, method)


def _eager_compiled_code() -> contextlib.AbstractContextManager[Any]:
    """``torch.compile``'s stance ``force_eager`` while the replay runs (torch 2.6 on, once dynamo is imported).

    Compiled code the walk could not see (a library's) then runs eagerly on the fakes and leaves dynamo's caches as
    they were: called under the replay's modes without it, a function not compiled yet was never compiled afterwards.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:  # nothing can have been compiled yet
        return contextlib.nullcontext()
    return set_stance("force_eager")  # type: ignore[no-any-return]


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """Put back on exit every generator the code run inside may draw from, as it was.

    Torch's CPU generator, every initialised CUDA generator, Python's ``random`` and NumPy's global generator (when
    NumPy is imported).
    """
    cpu_state = torch.get_rng_state()
    # torch ships is_initialized without annotations.
    cuda_initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_states = torch.cuda.get_rng_state_all() if cuda_initialized else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Restore the process-wide state on exit; silence the replayed code's output meanwhile.

    Silenced: its prints, the warnings it shows and its log records (all from the replaying thread only).

    Saved and restored: the generators (:func:`generators_kept`), the default dtype, grad mode, torch's intra-op
    thread count and the process environment (``os.environ``), autograd's anomaly detection, torch's warn-always
    flag. Meanwhile compiled code runs eagerly (:func:`_eager_compiled_code`), anomaly detection is off (it checks
    every backward result for NaN, and fake tensors have no values) and warn-always on: a ``TORCH_WARN_ONCE`` the
    replay reaches first (a preflight runs before step 0) would otherwise use up the one warning the run shows.
    """
    default_dtype = torch.get_default_dtype()
    grad_enabled = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    environment = dict(os.environ)
    anomaly = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
    warn_always = torch.is_warn_always_enabled()
    try:
        torch.set_anomaly_enabled(False)  # it reads every backward result's values, which fake tensors lack
        torch.set_warn_always(True)  # torch's warn-once warnings: warned (silenced), their once left to the run
        with generators_kept(), _quiet_thread(), _quiet_logs(), _eager_compiled_code():
            yield
    finally:
        if dict(os.environ) != environment:
            _restore_environment(environment)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad_enabled)
        torch.set_anomaly_enabled(*anomaly)
        torch.set_warn_always(warn_always)
        torch.set_default_dtype(default_dtype)
