"""Every tensor alive on the CPU during a sampled step, temporaries included: the real (live) peak of each phase.

On CUDA the allocator's peak counts every live tensor already; on the CPU nothing does, and the sum of the counted
parts (parameters, gradients, optimizer state, saved activations) leaves out the temporaries, the logits and their
gradient, the batch. :class:`LiveTensors` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees
each op's outputs as the step runs: each new storage on the device is added once, in ``nbytes`` (the CPU has no
allocator blocks), and removed when it is freed (a weak reference's callback), as the replay's own live count
(``prediction/replay/live.py``) does on fake tensors. It only reads what ops return: the step computes exactly what
it computes without it. It costs Python time per op, so it runs on sampled steps only.

A storage another thread frees (gloo's worker thread, which keeps a finished collective's tensors until it gets the
GIL back, after the step's code has let go of them: docs/measurement.md) was still allocated at the instants it
was counted at; where it was alive at a phase's peak, :meth:`LiveTensors.released_late` says how many bytes of that
peak were such, so that a replay (which has no such thread) is held to the peak with and without them.

``torch.utils._python_dispatch`` is private; ``TorchDispatchMode`` and its mode stack have had these names since
torch 2.0, and this module is the only place in ``measure/`` that names them; so is the torch-function mode
stack (``torch._C``'s ``_pop_torch_function_stack``, ``_push_on_torch_function_stack``,
``_len_torch_function_stack``, there since torch 2.0).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor, nn
from torch._C import (
    DisableTorchFunctionSubclass,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

from lightning_vram.measure.storages import gradient_of, local_tensor, on_device, storage_identity, tensor_storages
from lightning_vram.measure.tensors import iter_tensors, op_tensors
from lightning_vram.records import Phase


def dispatch_mode_active() -> bool:
    """Whether a dispatch mode (the user's, a tracer's, torch.compile's) is active on this thread now."""
    return _get_current_dispatch_mode() is not None


def outside_dispatch_modes() -> AbstractContextManager[Any]:
    """A context taking the dispatch modes active now off the stack, putting them back when it ends.

    The monitor's own work inside the user's step (a replay on fake tensors) runs there: a dispatch mode of the
    user's (an op counter, a ``FlopCounterMode`` spanning the step) sees the ops it sees without the monitor.
    """
    return _disable_current_modes()


@contextmanager
def outside_function_modes() -> Iterator[None]:
    """A context taking the torch-function modes active now off the stack, putting them back when it ends.

    A ``TorchFunctionMode`` of the user's (a call counter around ``fit``) sees every ``torch`` function and tensor
    method called under it: the monitor's own work runs here so that it sees none of them.
    """
    modes = [_pop_torch_function_stack() for _ in range(_len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_on_torch_function_stack(mode)


P = ParamSpec("P")
R = TypeVar("R")


def apart_from_function_modes(hook: Callable[P, R]) -> Callable[P, R]:
    """``hook`` run with the torch-function modes active now off the stack (put back after): a decorator.

    The monitor's hooks (its Callback's, a sampled step's module, saved-tensor and gradient hooks) run under it: a
    ``TorchFunctionMode`` of the user's spanning the steps or ``fit`` (a call counter) sees none of the monitor's
    own torch calls, its replays' included, as a dispatch mode of theirs sees none of its ops.
    """

    @functools.wraps(hook)
    def apart(*args: P.args, **kwargs: P.kwargs) -> R:
        with DisableTorchFunctionSubclass():  # a tensor subclass's __torch_function__ is the user's code too
            if not _len_torch_function_stack():  # the usual case, on every step: no context to enter
                return hook(*args, **kwargs)
            with outside_function_modes():
                return hook(*args, **kwargs)

    return apart


def leave_abandoned() -> int:
    """Take off the mode stack the live counts left on top of it; returns how many.

    A live count stays on the stack when a session was dropped mid-step, or when the user's own dispatch mode,
    entered after it, was still active when the count stopped (it passes every op through from then on). Call only
    where no live count of this process is running (one sampled step at a time per process): any
    :class:`LiveTensors` on top of the stack is then one of those. Each one taken off shortens the stack: this ends.
    """
    left = 0
    while isinstance(mode := _get_current_dispatch_mode(), LiveTensors):
        mode.leave()
        left += 1
    return left


def state_tensors(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any) -> list[Tensor]:
    """The tensors alive when a step starts, as the replay registers them.

    Parameters, buffers, gradients, optimizer state, and the batch.
    """
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [gradient for gradient in map(gradient_of, module.parameters()) if gradient is not None]
    for optimizer in optimizers:
        tensors += iter_tensors(list(optimizer.state.values()))
    return [*tensors, *iter_tensors(batch)]


# torch ships TorchDispatchMode without annotations.
class LiveTensors(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live bytes on ``device`` and the highest of them in each phase, in bytes (storage ``nbytes``).

    Register the tensors alive before the step with :meth:`track`, call :meth:`start` to enter the mode at the
    step's start, :meth:`close_segment` at each phase boundary with the phase that ran since the last one (as
    :class:`~lightning_vram.measure.accounting.StepAttributor` counts segments), and :meth:`stop` at its end (safe
    at any time, more than once). A segment's peak starts from the bytes live when it starts; a phase met twice in
    a step keeps its highest.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._device = device
        self._thread = threading.get_ident()  # the step's: a free on any other thread is a late release
        # Another thread's free runs between any two of the step's bytecodes; this thread's own, wherever an
        # allocation starts a garbage collection (inside a held lock too: reentrant).
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}
        self._born: dict[int, int] = {}  # each storage's instant of counting (see _instant)
        self._references: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.live_bytes = 0
        """Bytes of the storages alive now that this tracker has seen."""
        self._instant = 0  # counts each storage counted or freed: orders them against each phase's peak
        self._segment_peak = 0
        self._segment_peak_at = 0
        self._segment_late = 0  # bytes alive at the open segment's peak that another thread has freed since
        self.phase_peaks: dict[Phase, int] = {}
        """The highest live bytes of each phase whose segment has closed."""
        self._peak_at: dict[Phase, int] = {}
        self._late: dict[Phase, int] = {}
        self._held: list[int] = []  # bytes of each storage held from the start, not yet seen (see hold)
        self._entered = False
        self._counting = True
        self.error: Exception | None = None
        """The first error raised while counting; from then on the mode passes every op through untouched."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled under this mode, as it does in training (torch's switch for a mode).

        Otherwise dynamo runs a compiled function eagerly while any mode is active, which rounds differently. The
        sampled step's live count stands aside for the compiled code the walk finds; this covers what it cannot see
        (a plain loop's own body, a callback's hook, a library's code), whose tensors made inside the compiled graph
        are then not in the live peak.
        """
        return True

    def hold(self, sizes: Iterable[int]) -> None:
        """Count storages alive before the step that nothing registers, by their bytes, from now on.

        The step's code holds no reference to them (DDP's gradient buckets, inside its C++ Reducer): each counts
        from the start, and the first op that writes into an unseen storage of one of these sizes is taken to be
        writing into it (it is counted once, and uncounted when freed).
        """
        with self._lock:
            for nbytes in sizes:
                self._held.append(nbytes)
                self.live_bytes += nbytes
            self._new_peak()

    def track(self, tensors: Iterable[Any], written: bool = False) -> None:
        """Count the storages of ``tensors`` on the device (each once) until they are freed; others are skipped.

        ``written``: the tensors are what an op wrote into (in place, or ``out=``), not what it allocated; an unseen
        one may be a storage :meth:`hold` counts already.
        """
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                continue
            local = local_tensor(tensor)
            if not on_device(local, self._device):
                continue
            for storage in tensor_storages(local) or ():
                self._add(storage, written)
        with self._lock:
            self._new_peak()

    def _new_peak(self) -> None:
        """Where the live bytes are the open segment's highest yet, that is its peak now (call holding the lock)."""
        if self.live_bytes > self._segment_peak:
            self._segment_peak, self._segment_peak_at, self._segment_late = self.live_bytes, self._instant, 0

    def _add(self, storage: torch.UntypedStorage, written: bool = False) -> None:
        key = storage_identity(storage)
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        reference = weakref.ref(storage, self._freed_callback(key))
        with self._lock:
            self._instant += 1
            self._sizes[key], self._born[key], self._references[key] = nbytes, self._instant, reference
            if written and nbytes in self._held:
                self._held.remove(nbytes)  # counted since the start, by hold
                return
            self.live_bytes += nbytes

    def _freed_callback(self, key: int) -> Any:
        def freed(_reference: object) -> None:
            late = threading.get_ident() != self._thread
            with self._lock:
                self._instant += 1
                nbytes, born = self._sizes.pop(key, 0), self._born.pop(key, None)
                self._references.pop(key, None)
                self.live_bytes -= nbytes
                if not late or born is None:
                    return
                if self._counting and born <= self._segment_peak_at:
                    self._segment_late += nbytes
                for phase, peak_at in self._peak_at.items():
                    if born <= peak_at:
                        self._late[phase] = self._late.get(phase, 0) + nbytes

        return freed

    def released_late(self) -> dict[Phase, int]:
        """Of each phase's peak, the bytes another thread freed later (in bytes; phases with none left out).

        Such a storage was still allocated at the peak, after the step's own code had let go of it: gloo's worker
        thread, which keeps a finished collective's tensors until it gets the GIL. The step itself, without that
        thread's delay, peaked between ``phase_peaks[phase]`` less these bytes and ``phase_peaks[phase]``. Frees
        after :meth:`stop` count too, until :meth:`forget`: read it as late as the caller can (after a replay).
        """
        with self._lock:
            return {phase: nbytes for phase, nbytes in self._late.items() if nbytes}

    def start(self) -> None:
        """Enter the mode: from now on every op's outputs are counted (until :meth:`stop`)."""
        with self._lock:
            self._segment_peak, self._segment_peak_at, self._segment_late = self.live_bytes, self._instant, 0
        self.__enter__()  # type: ignore[no-untyped-call]
        self._entered = True

    def close_segment(self, phase: Phase) -> None:
        """The segment since the last boundary ran ``phase``: keep its peak; the next starts from what is live now."""
        with self._lock:
            if self._segment_peak > self.phase_peaks.get(phase, -1):
                self.phase_peaks[phase], self._peak_at[phase] = self._segment_peak, self._segment_peak_at
                self._late[phase] = self._segment_late
            self._segment_peak, self._segment_peak_at, self._segment_late = self.live_bytes, self._instant, 0

    def stop(self) -> bool:
        """Leave the mode; forget every storage but those alive at a phase's peak. Returns whether counts are whole.

        Those alive at a peak are watched until :meth:`forget`, for :meth:`released_late`. The counts are not whole
        when counting failed, or when another mode entered after this one is still active: that mode
        is left in place (leaving this one would pop the user's), and this one stays below it, passing every op
        through untouched, until :func:`leave_abandoned` takes it off once the user's mode has left.
        """
        whole = self.error is None
        self._counting = False
        if self._entered:
            self._entered = False
            if _get_current_dispatch_mode() is self:
                self.leave()
            else:
                whole = False
        with self._lock:
            latest_peak = max(self._peak_at.values(), default=0)
            for key in [key for key, born in self._born.items() if born > latest_peak]:
                del self._sizes[key], self._born[key], self._references[key]  # its weak reference dies with it
            self._held.clear()
        return whole

    def forget(self) -> None:
        """Forget every storage: no weak reference's callback reaches this tracker again."""
        with self._lock:
            self._sizes.clear()
            self._born.clear()
            self._references.clear()

    def leave(self) -> None:
        """Take this mode off the stack; call only while it is on top (it pops the top)."""
        self._counting = False
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Called from Python here, an op on a tensor subclass's instances would run its __torch_function__ again,
        # and reading the outputs would too: the user's code, which training without the monitor does not run.
        with DisableTorchFunctionSubclass():
            output = func(*args, **(kwargs or {}))
            if self._counting:
                try:
                    written = bool(self._held) and func._schema.is_mutable
                    self.track(op_tensors(output), written)
                except Exception as error:  # noqa: BLE001 -- inside the user's step: stop counting, never raise
                    self.error, self._counting = error, False
        return output
