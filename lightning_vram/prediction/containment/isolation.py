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
import decimal
import functools
import logging
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, TextIO

import torch
import torch.utils._device
from torch.overrides import _get_current_function_mode_stack


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


Setting = tuple[Callable[[], object], Callable[[Any], object]]
"""A process-wide setting as its reader and its writer."""


@contextlib.contextmanager
def _settings_kept(settings: Sequence[Setting]) -> Iterator[None]:
    """Write back on exit, in order, each setting whose value changed; an unchanged one is not written.

    A setting whose reader raises on entry is left alone (torch's legacy TF32 readers raise once the new
    ``fp32_precision`` API was mixed in).
    """
    saved: list[tuple[Setting, object]] = []
    for setting in settings:
        with contextlib.suppress(RuntimeError):
            saved.append((setting, setting[0]()))
    try:
        yield
    finally:
        for (read, write), value in saved:
            try:
                changed = read() != value
            except RuntimeError:
                changed = True
            if changed:
                write(value)


def _deterministic_settings() -> list[Setting]:
    """``torch.use_deterministic_algorithms``'s flag and its ``warn_only``, as one setting."""

    def read() -> tuple[bool, bool]:
        return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()

    def write(value: tuple[bool, bool]) -> None:
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])

    return [(read, write)]


FP32_PRECISIONS = (
    ("generic", "all"),
    *((backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")),
)
"""The (backend, operator) pairs of torch's ``fp32_precision`` settings (torch 2.9 on), parents first."""


def _backend_settings() -> list[Setting]:
    """The cuDNN and cuBLAS flags and torch's float32 precisions, those this torch has, in the order written back.

    cuDNN's enabled, benchmark and deterministic flags, the float32 matmul precision, cuBLAS's reduced-precision
    reductions (allowed, split-K), each ``fp32_precision`` (torch 2.9 on), then the legacy TF32 flags (``allow_tf32``:
    writing one sets its ``fp32_precision`` pairs and clears torch's record of the two APIs mixed). Read and written
    through ``torch._C``: ``torch.backends.cudnn``'s own setters refuse inside ``cudnn.flags()``. Not kept: that
    record itself where the user had already mixed the two APIs before the replay (the legacy readers raise then).
    """
    c: Any = torch._C
    names = [
        ("_get_cudnn_enabled", "_set_cudnn_enabled"),
        ("_get_cudnn_benchmark", "_set_cudnn_benchmark"),
        ("_get_cudnn_deterministic", "_set_cudnn_deterministic"),
        ("_get_float32_matmul_precision", "_set_float32_matmul_precision"),
    ]
    settings: list[Setting] = [(getattr(c, get), getattr(c, put)) for get, put in names if hasattr(c, get)]
    for reduction in ("fp16", "bf16"):  # (allowed, split-K)
        get = getattr(c, f"_get_cublas_allow_{reduction}_reduced_precision_reduction", None)
        put = getattr(c, f"_set_cublas_allow_{reduction}_reduced_precision_reduction", None)
        if get is not None and put is not None:
            settings.append((get, functools.partial(_put_pair, put)))
    if hasattr(c, "_get_fp32_precision_getter"):
        for backend, op in FP32_PRECISIONS:
            getter = functools.partial(c._get_fp32_precision_getter, backend, op)
            settings.append((getter, functools.partial(c._set_fp32_precision_setter, backend, op)))
    names = [
        ("_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
        ("_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
    ]
    settings += [(getattr(c, get), getattr(c, put)) for get, put in names if hasattr(c, get)]
    return settings


def _put_pair(put: Callable[..., object], value: tuple[bool, bool]) -> None:
    """Write a setting that torch reads as a pair and writes as two arguments."""
    put(*value)


def _recursion_settings() -> list[Setting]:
    """Python's recursion limit (frames)."""
    return [(sys.getrecursionlimit, sys.setrecursionlimit)]


@contextlib.contextmanager
def _decimal_context_kept() -> Iterator[None]:
    """Keep this thread's ``decimal`` context as it was, the same object with the same settings and flags.

    Code that sets a new context (``decimal.setcontext``) sets it in the replay's copy of the context variables; code
    that changes the current one in place (``getcontext().prec += 1``) changes the user's object: it is put back in
    place.
    """
    context = decimal.getcontext()
    saved = context.copy()
    try:
        yield
    finally:
        if decimal.getcontext() is not context:
            decimal.setcontext(context)
        for name in ("prec", "rounding", "Emin", "Emax", "capitals", "clamp"):
            if getattr(context, name) != getattr(saved, name):
                setattr(context, name, getattr(saved, name))
        for signals, was in ((context.flags, saved.flags), (context.traps, saved.traps)):
            for signal, value in was.items():
                if signals[signal] != value:
                    signals[signal] = value


@contextlib.contextmanager
def _default_device_kept() -> Iterator[None]:
    """Keep torch's default device as it was: the torch-function mode stack, the global ``DeviceContext``, its device.

    ``torch.set_default_device`` exits the thread's global ``DeviceContext`` (``torch._GLOBAL_DEVICE_CONTEXT``) and
    enters a new one at the bottom of the mode stack (``torch/utils/_device.py``); left there after a replay (which runs
    with the user's modes off the stack) the user's next call finds two and raises. The same modes, the same global
    context and ``torch.utils._device.CURRENT_DEVICE`` are put back where any of them changed.
    """
    local = torch._GLOBAL_DEVICE_CONTEXT
    absent = object()
    context = getattr(local, "device_context", absent)
    current = torch.utils._device.CURRENT_DEVICE
    modes = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        now = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
        if len(now) != len(modes) or any(a is not b for a, b in zip(now, modes, strict=True)):
            for _ in now:
                torch._C._pop_torch_function_stack()
            for mode in modes:
                torch._C._push_on_torch_function_stack(mode)
        if getattr(local, "device_context", absent) is not context:
            if context is absent:
                del local.device_context
            else:
                local.device_context = context
        torch.utils._device.CURRENT_DEVICE = current


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
    flag; torch's deterministic-algorithms flag, cuDNN/cuBLAS flags and float32 precisions (:func:`_backend_settings`),
    Python's recursion limit, the ``decimal`` context (:func:`_decimal_context_kept`) and the default device
    (:func:`_default_device_kept`). Meanwhile compiled code runs eagerly (:func:`_eager_compiled_code`), anomaly
    detection is off (it checks every backward result for NaN, and fake tensors have no values) and warn-always on: a
    ``TORCH_WARN_ONCE`` the replay reaches first (a preflight runs before step 0) would otherwise use up the one
    warning the run shows.
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
        with (
            generators_kept(),
            _settings_kept(_deterministic_settings() + _backend_settings() + _recursion_settings()),
            _decimal_context_kept(),
            _default_device_kept(),
            _quiet_thread(),
            _quiet_logs(),
            _eager_compiled_code(),
        ):
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
