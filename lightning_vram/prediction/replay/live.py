"""Every tensor alive on the device during a replay, temporaries included: the allocator's peak, predicted.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each op's outputs as it runs (under fake tensors,
their shapes only). Each new storage on the counted device is added (on CUDA in whole allocator blocks, elsewhere
in bytes, as the sampled step's live count, :mod:`lightning_vram.measure.live`, counts) and removed when the
storage is freed (a weak reference's callback), the way :class:`torch.distributed._tools.mem_tracker.MemTracker`
does. Kernel-internal workspaces (cuBLAS, cuDNN) are not tensors and are not counted here.

The same sequence, storage by storage, is what the device's allocator is asked for: an
:class:`AllocationListener` given to :class:`LiveMemory` is told of each new storage on the counted device (its size
as requested, not rounded), of each free, and of each phase's start, so that a model of the CUDA caching allocator
can be driven by the replay.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_vram.measure.storages import local_tensor, on_device, storage_key
from lightning_vram.measure.tensors import op_tensors
from lightning_vram.prediction.replay._fake import TorchDispatchMode
from lightning_vram.prediction.replay.ops import device_query, op_name
from lightning_vram.prediction.replay.storages import allocator_bytes
from lightning_vram.records import Phase


class AllocationListener(Protocol):
    """Told of the replay's allocations and frees on the counted device, in order (a caching allocator's model).

    Blocks are identified by an int: a storage's identity, or a negative number for a library's workspace.
    """

    def malloc(self, block: int, size: int, stream: int = 0) -> None:
        """Block ``block`` of ``size`` bytes (as requested: the allocator rounds it) is allocated on ``stream``."""

    def free(self, block: int) -> None:
        """Block ``block`` is freed."""

    def reset_peaks(self) -> None:
        """A phase starts: its peaks start from what is held now (as the monitor resets torch's peak counters)."""


class Sampler(Protocol):
    """Told of each phase's start and of each op, once the op's outputs are counted (a timeline's recorder)."""

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts now."""

    def sample(self, op: str) -> None:
        """Op ``op`` (no namespace, no overload) ran."""


# torch ships TorchDispatchMode without annotations.
class LiveMemory(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live allocator bytes on ``device`` and the highest of them in each phase.

    Register the tensors that exist before the replay with :meth:`track`; enter the mode inside the fake mode so
    that it sees the fake outputs. :meth:`start_phase` begins a phase's peak from what is live then, as the
    monitor's reset of the allocator's peak at each phase boundary does. ``allocations`` is told of every storage
    allocated and freed on the device, and of each phase's start.
    """

    def __init__(self, device: torch.device, allocations: AllocationListener | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._device = device
        self._allocations = allocations
        self._allocated: set[int] = set()  # the storages the listener was told of (an empty one is not)
        self._sizes: dict[int, int] = {}
        self._references: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._producers: dict[int, str] = {}
        self.live_bytes = 0
        self._phase: Phase | None = None
        self._segment_peak = 0
        self._closed: dict[Phase, int] = {}  # the highest live bytes of each phase whose segment has closed
        self._listeners: list[Callable[[Any], None]] = []
        self._op_listeners: list[Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]] = []
        self._samplers: list[Sampler] = []

    def add_listener(self, listener: Callable[[Any], None]) -> None:
        """Also hand every op's output to ``listener`` (after it is tracked)."""
        self._listeners.append(listener)

    def add_op_listener(self, listener: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]) -> None:
        """Also hand every op (``func``, ``args``, ``kwargs``, its output) to ``listener``, as it ran."""
        self._op_listeners.append(listener)

    def add_sampler(self, sampler: Sampler) -> None:
        """Also tell ``sampler`` of each phase's start and, after the listeners, of every op."""
        self._samplers.append(sampler)

    def remove_sampler(self, sampler: Sampler) -> None:
        """Tell ``sampler`` nothing more (one added by :meth:`add_sampler`)."""
        self._samplers.remove(sampler)

    def track(self, tensors: Iterable[Tensor], producer: str | None = None) -> None:
        """Count the storages of ``tensors`` (each once) until they are freed."""
        for each in tensors:
            # A DTensor (FSDP2's sharded parameters, their gradients and state): the shard this rank holds.
            tensor = local_tensor(each) if isinstance(each, Tensor) else each
            if not isinstance(tensor, Tensor) or not on_device(tensor, self._device):
                continue
            key = storage_key(tensor)
            if key in self._sizes:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if self._allocations is not None and nbytes > 0:  # torch's allocator hands out nothing for 0 bytes
                self._allocations.malloc(key, nbytes)
                self._allocated.add(key)
            if self._device.type == "cuda":
                nbytes = allocator_bytes(nbytes)
            self._sizes[key] = nbytes
            self._references[key] = weakref.ref(storage, self._freed_callback(key))
            if producer is not None:
                self._producers[key] = producer
            self.live_bytes += nbytes
        self._observe()

    def _freed_callback(self, key: int) -> Any:
        def freed(_reference: object) -> None:
            self.live_bytes -= self._sizes.pop(key, 0)
            self._references.pop(key, None)
            self._producers.pop(key, None)
            if key in self._allocated and self._allocations is not None:
                self._allocated.discard(key)
                self._allocations.free(key)

        return freed

    def producer(self, key: int) -> str | None:
        """The name of the op (``_log_softmax``: no namespace, no overload) that produced storage ``key``, if seen."""
        return self._producers.get(key)

    @property
    def phase_peaks(self) -> dict[Phase, int]:
        """The highest live bytes of each phase so far (the open segment's included), bytes."""
        peaks = dict(self._closed)
        if self._phase is not None:
            peaks[self._phase] = max(peaks.get(self._phase, 0), self._segment_peak)
        return peaks

    def start_phase(self, phase: Phase, ended: Phase | None = None) -> None:
        """A phase starts: its peak starts from the bytes live now.

        ``ended``: the phase the segment that ends now is counted as, where it is not the one it started as (under
        manual optimization, the segment from an optimizer step to the next backward is a forward pass, as the
        monitor counts it); ``None``: the phase it started as.
        """
        self._close_segment(ended)
        self._phase = phase
        self._segment_peak = self.live_bytes
        for sampler in self._samplers:
            sampler.start_phase(phase)
        if self._allocations is not None:
            self._allocations.reset_peaks()

    def _close_segment(self, ended: Phase | None) -> None:
        counted = ended or self._phase
        if counted is not None and self._phase is not None:
            self._closed[counted] = max(self._closed.get(counted, 0), self._segment_peak)

    def restart(self) -> dict[Phase, int]:
        """Close the open segment and start counting peaks afresh: the peaks so far, by phase (bytes).

        Between an accumulation window's micro-batches, each counted on its own.
        """
        peaks = self.phase_peaks
        self._closed, self._phase = {}, None
        return peaks

    def _observe(self) -> None:
        if self._phase is not None and self.live_bytes > self._segment_peak:
            self._segment_peak = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        device = device_query(func, args)
        if device is not None:  # a fake tensor's device, asked by C++: not an op (the real step does not dispatch it)
            return device
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        name = op_name(func)
        self.track(op_tensors(output), name)
        for listener in self._listeners:
            listener(output)
        for op_listener in self._op_listeners:
            op_listener(func, args, kwargs, output)
        for sampler in self._samplers:
            sampler.sample(name)
        return output
