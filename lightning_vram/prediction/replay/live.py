"""Every tensor alive on the device during a replay, temporaries included: the allocator's peak, predicted.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees each op's outputs as it runs (under fake tensors,
their shapes only). Each new storage on the counted device is added (on CUDA in whole allocator blocks, elsewhere
in bytes, as the sampled step's live count, :mod:`lightning_vram.measure.live`, counts) and removed when the
storage is freed (a weak reference's callback), the way :class:`torch.distributed._tools.mem_tracker.MemTracker`
does. Kernel-internal workspaces (cuBLAS, cuDNN) are not tensors and are not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_vram.measure.storages import on_device, storage_key
from lightning_vram.prediction.replay._fake import TorchDispatchMode, tree_leaves
from lightning_vram.prediction.replay.storages import allocator_bytes
from lightning_vram.records import Phase


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
    monitor's reset of the allocator's peak at each phase boundary does.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._device = device
        self._sizes: dict[int, int] = {}
        self._references: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._producers: dict[int, str] = {}
        self.live_bytes = 0
        self._phase: Phase | None = None
        self.phase_peaks: dict[Phase, int] = {}
        self._listeners: list[Callable[[Any], None]] = []
        self._samplers: list[Sampler] = []

    def add_listener(self, listener: Callable[[Any], None]) -> None:
        """Also hand every op's output to ``listener`` (after it is tracked)."""
        self._listeners.append(listener)

    def add_sampler(self, sampler: Sampler) -> None:
        """Also tell ``sampler`` of each phase's start and, after the listeners, of every op."""
        self._samplers.append(sampler)

    def track(self, tensors: Iterable[Tensor], producer: str | None = None) -> None:
        """Count the storages of ``tensors`` (each once) until they are freed."""
        for tensor in tensors:
            if not isinstance(tensor, Tensor) or not on_device(tensor, self._device):
                continue
            key = storage_key(tensor)
            if key in self._sizes:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
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

        return freed

    def producer(self, key: int) -> str | None:
        """The name of the op (``_log_softmax``: no namespace, no overload) that produced storage ``key``, if seen."""
        return self._producers.get(key)

    def start_phase(self, phase: Phase) -> None:
        """A phase starts: its peak starts from the bytes live now."""
        self._phase = phase
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.live_bytes)
        for sampler in self._samplers:
            sampler.start_phase(phase)

    def _observe(self) -> None:
        phase = self._phase
        if phase is not None and self.live_bytes > self.phase_peaks[phase]:
            self.phase_peaks[phase] = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        name = _op_name(func)
        self.track((leaf for leaf in tree_leaves(output) if isinstance(leaf, Tensor)), name)
        for listener in self._listeners:
            listener(output)
        for sampler in self._samplers:
            sampler.sample(name)
        return output


def _op_name(func: Any) -> str:
    """An op's name without namespace or overload: ``aten._log_softmax.default`` -> ``_log_softmax``."""
    return str(getattr(func, "__name__", func)).split(".")[0]
