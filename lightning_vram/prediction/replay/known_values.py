"""The real values of the batch's small tensors, carried through the replay so that the step takes its real branches.

Fake tensors have shapes but no values, so a step that reads one (``if attention_mask.all():``, ``.item()``) cannot
be replayed, and a library that sees a fake tensor takes its tracing branch (transformers then builds a full attention
mask and repeats grouped-query key/value heads, which the real step does not). :class:`KnownValues` keeps, beside each
fake tensor made from the batch, a CPU copy of its real value, and works out the value of every op whose tensor
inputs all have known values (masks, position ids, lengths), as long as it stays small: a value read
(``_local_scalar_dense``), and an op whose output shape depends on the data (``nonzero``), then give the real
result. A tensor computed from the model's weights never has a value: the replay does not compute anything real with
the model.

Cost: one Python call per op of the replay, and real CPU work only for the few ops on known values. The replay runs
inside the training step's hooks, which never wait for the device: a batch on a CUDA device is copied to pinned host
memory without blocking as the replay starts (queued behind the step's own work), and its value is known only if that
copy has arrived when the replay first needs it (its event polled for up to :data:`ARRIVAL_SECONDS`, never waited on);
otherwise it is not known, as a tensor computed from the weights is not. A real tensor on a device reached by the
replay is never read.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_vram.measure.storages import storage_key
from lightning_vram.measure.tensors import iter_tensors, op_tensors
from lightning_vram.prediction.replay._fake import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    TorchDispatchMode,
    tree_map_only,
)
from lightning_vram.prediction.replay.ops import device_query, op_name, written_arguments

VALUE_ELEMENTS = 1 << 20
"""The most elements a known value may have (a 1M-element mask: 8 MiB of ``int64`` on the CPU at most)."""
VALUE_BYTES = 64 * 1024 * 1024
"""The most bytes the known values of one replay may hold on the CPU together; past it, new values are not kept."""
DETERMINISTIC_FACTORIES = frozenset(
    {"arange", "full", "ones", "zeros", "scalar_tensor", "eye", "linspace", "tril_indices"}
)
"""Ops that make a tensor from nothing but their arguments, whose values are known (``empty`` is not: uninitialised)."""
VALUE_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "allclose"})
"""Ops that turn a tensor's value into a Python value."""

ARRIVAL_SECONDS = 2.0
"""How long a replay looks for a CUDA batch's copy to arrive, polling its event (``Event.query``, which never waits on
the device), before taking the value as unknown. The copy is queued behind the step's own kernels, which the replay
(seconds of host work on a sampled step, once a run) outlasts anyway; polling keeps the prediction the same from run
to run where a step's queued work takes under this long."""
ARRIVAL_POLL_SECONDS = 0.0005
"""The pause between two polls of a copy's event."""

aten = torch.ops.aten


def arrived(event: Any, seconds: float) -> bool:
    """Whether ``event`` (a recorded ``torch.cuda.Event``) completes within ``seconds``, polled without blocking."""
    deadline = time.monotonic() + seconds
    while not event.query():  # cudaEventQuery: does not wait
        if time.monotonic() >= deadline:
            return False
        time.sleep(ARRIVAL_POLL_SECONDS)
    return True


TakenValues = dict[int, tuple["weakref.ref[Tensor]", Tensor]]
"""A batch's tensors' values as a step started: by the tensor's ``id``, a weak reference to it and its copy."""


def taken_values(batch: Any) -> TakenValues:
    """Copies of the batch's small CPU tensors as they are now, by the tensor's ``id``: taken as a sampled step starts.

    The replay runs at the step's end, when the step may have changed its batch in place (a mask inverted, labels
    shifted): the values it carries are the ones the step started from. Plain tensors in dicts, lists and tuples only
    (a subclass's ``clone`` is the user's code); within :data:`VALUE_ELEMENTS` each and :data:`VALUE_BYTES` together.
    Host work only: a CUDA batch is copied when the replay starts, as before. Weak references: a tensor the step
    replaced in its batch is not kept alive, and a new one that took its ``id`` is not taken for it.
    """
    copies: TakenValues = {}
    total = 0
    with _no_modes(), torch.no_grad():
        for tensor in iter_tensors(batch):
            if type(tensor) is not Tensor or tensor.device.type != "cpu" or tensor.is_sparse or id(tensor) in copies:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.numel() <= VALUE_ELEMENTS and total + nbytes <= VALUE_BYTES:
                copies[id(tensor)] = (weakref.ref(tensor), tensor.detach().clone())
                total += nbytes
    return copies


class NotOnTheHost(RuntimeError):
    """An op on known values also takes a real tensor on a device, whose value the replay does not read."""


# torch ships TorchDispatchMode without annotations.
class KnownValues(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Real CPU values beside fake tensors: given for the batch, worked out for every op on known values only.

    Enter it inside the fake mode (the innermost mode), after registering the batch with :meth:`know`.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._values = WeakTensorKeyDictionary()  # by identity: a tensor's == is an op
        self._uncopied = WeakTensorKeyDictionary()  # the batch's values still the user's tensors, copied when read
        self._arriving = WeakTensorKeyDictionary()  # the batch's values on their way from a CUDA device: their events
        self._bytes = 0

    def know(self, pairs: Iterable[tuple[Tensor, Tensor]], taken: TakenValues | None = None) -> None:
        """Keep the real value of each ``(fake, real)`` pair where it is small enough (copied to the CPU when read).

        ``taken``: :func:`taken_values` of the batch, the values the step started from, kept instead of ``real``'s.
        """
        for fake, real in pairs:
            if isinstance(fake, FakeTensor) and isinstance(real, Tensor) and not isinstance(real, FakeTensor):
                original, value = (taken or {}).get(id(real), (None, real))
                self._keep(fake, value if original is None or original() is real else real)

    def value_of(self, tensor: Tensor) -> Tensor | None:
        """The real value of a fake tensor, or ``None`` when it is not known.

        A value whose copy from the device has not arrived when first asked for (polled for up to
        :data:`ARRIVAL_SECONDS`) is not known from then on.
        """
        if tensor not in self:
            return None
        value = self._values.get(tensor)  # type: ignore[no-untyped-call]  # torch ships it unannotated
        if not isinstance(value, Tensor):
            return None
        if self._uncopied.pop(tensor, None) is not None:  # type: ignore[no-untyped-call]  # torch ships it unannotated
            with _no_modes(), torch.no_grad():
                value = value.clone()  # the replay's own copy (on the CPU): ops on it never touch the user's tensor
            self._values[tensor] = value
        return value

    def _forget(self, tensor: Tensor) -> None:
        """``tensor`` was written with values not known: so were its base and every view of the same storage."""
        written = storage_key(tensor)
        keys = list(self._values.keys())  # type: ignore[no-untyped-call]  # torch ships it unannotated
        for known in [key for key in keys if storage_key(key) == written]:
            self._values.pop(known, None)  # type: ignore[no-untyped-call]  # torch ships it unannotated
            self._uncopied.pop(known, None)  # type: ignore[no-untyped-call]  # torch ships it unannotated

    def __contains__(self, tensor: object) -> bool:
        """Whether ``tensor``'s value is known.

        One still on its way from the device after :func:`arrived`'s polling (never a device wait) is forgotten.
        """
        if not isinstance(tensor, Tensor) or tensor not in self._values:
            return False
        arriving = self._arriving.get(tensor)  # type: ignore[no-untyped-call]  # torch ships it unannotated
        if arriving is None:
            return True
        del self._arriving[tensor]
        if arrived(arriving, ARRIVAL_SECONDS):
            return True
        self._values.pop(tensor, None)  # type: ignore[no-untyped-call]  # torch ships it unannotated
        return False

    def _keep(self, fake: Tensor, real: Tensor) -> None:
        if real.is_sparse or real.numel() > VALUE_ELEMENTS or real.device.type not in ("cpu", "cuda"):
            return
        nbytes = real.numel() * real.element_size()
        if self._bytes + nbytes > VALUE_BYTES:
            return
        with _no_modes(), torch.no_grad():
            if real.device.type == "cpu":
                self._values[fake] = real.detach()
                self._uncopied[fake] = True
            else:  # queued now without blocking (into pinned memory), read only once arrived
                self._values[fake] = real.detach().to("cpu", copy=True, non_blocking=True)
                arriving = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch ships it unannotated
                arriving.record(torch.cuda.current_stream(real.device))
                self._arriving[fake] = arriving
        self._bytes += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        device = device_query(func, args)
        if device is not None:  # a fake tensor's device: no value, nothing written
            return device
        kwargs = kwargs or {}
        name = op_name(func)
        inputs = op_tensors((args, kwargs))
        fakes = [leaf for leaf in inputs if isinstance(leaf, FakeTensor)]
        made = not inputs and name in DETERMINISTIC_FACTORIES
        known = all(fake in self for fake in fakes) and (bool(fakes) or made)
        if known and name in VALUE_READS:
            try:
                return self._real(func, args, kwargs)
            except NotOnTheHost:  # a real device tensor among the inputs: the fake op raises as for any unknown value
                known = False
        try:
            output = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as unknown:
            if not known or not fakes:
                raise
            try:
                return self._with_real_shapes(func, args, kwargs, fakes[0].device)
            except NotOnTheHost:
                raise unknown from None
        if known:
            self._value_outputs(func, args, kwargs, output)
        else:
            self._forget_written(func, args, kwargs)
        return output

    def _real(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run ``func`` on the known values (on the CPU, outside every mode)."""
        real_args, real_kwargs = tree_map_only(Tensor, self._real_of, (args, kwargs))
        if "device" in real_kwargs:
            real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
        with _no_modes(), torch.no_grad():
            return func(*real_args, **real_kwargs)

    def _real_of(self, tensor: Tensor) -> Tensor:
        """The value to compute with: the known value of a fake tensor; a copy of a real CPU one (never written).

        Raises:
            NotOnTheHost: ``tensor`` is a real tensor on a device (reading it would wait for the device).
        """
        if not isinstance(tensor, FakeTensor):
            if tensor.device.type != "cpu":
                raise NotOnTheHost(f"a real tensor on {tensor.device}")
            return tensor.detach().clone()  # _real runs with every mode off
        value = self.value_of(tensor)
        if value is None:
            raise KeyError("no known value")
        return value

    def _value_outputs(self, func: Any, args: Any, kwargs: Any, output: Any) -> None:
        """Work out the real value of each of ``output``'s tensors; where that fails they stay unknown."""
        fakes = [leaf for leaf in op_tensors(output) if isinstance(leaf, FakeTensor)]
        if not fakes or sum(fake.numel() for fake in fakes) > VALUE_ELEMENTS:
            self._forget_written(func, args, kwargs)
            return
        try:
            real = self._real(func, args, kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):  # what an op raises: the value stays unknown
            self._forget_written(func, args, kwargs)
            return
        reals = op_tensors(real)
        if len(reals) != len(fakes):
            return
        for fake, value in zip(fakes, reals, strict=True):
            if tuple(fake.shape) == tuple(value.shape) and fake.dtype == value.dtype:
                self._values[fake] = value
                self._bytes += value.numel() * value.element_size()

    def _forget_written(self, func: Any, args: Any, kwargs: Any) -> None:
        """An op whose inputs are not all known wrote into some of them: their values are no longer known."""
        positions, names = written_arguments(func)
        for position in positions:
            if position < len(args) and isinstance(args[position], Tensor):
                self._forget(args[position])
        for name in names:
            if isinstance(kwargs.get(name), Tensor):
                self._forget(kwargs[name])

    def _with_real_shapes(self, func: Any, args: Any, kwargs: Any, device: torch.device) -> Any:
        """An op whose output shape depends on the data: fake outputs shaped as the real ones, with their values."""
        real = self._real(func, args, kwargs)

        def fake_like(value: Tensor) -> Tensor:
            fake: Tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
            self._values[fake] = value
            return fake

        return tree_map_only(Tensor, fake_like, real)


@contextmanager
def _no_modes() -> Iterator[None]:
    """Every dispatch mode (fake, live memory, deadline) off: the ops run on real CPU tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
