"""Live bytes while a step runs: the activations autograd holds for backward, and the gradients backward creates.

Both ledgers work on storage keys (see :mod:`~lightning_vram.measure.storages`): ``StorageWeakRef`` identities, on a
sampled step as on a replayed one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_vram.measure.deepspeed_zero import partition_gradients
from lightning_vram.measure.storages import StorageBytes, StorageKey, add_storage, gradient_of, storage_identity
from lightning_vram.measure.tensors import without_history


class SavedTensor:
    """A tensor autograd saved, as the monitor's saved-tensor hooks keep it: without its history, with its version.

    Saved-tensor hooks switch off autograd's own check that a saved tensor was not modified in place before backward
    used it; :meth:`unpack` makes that check instead, so an in-place change that breaks the user's backward raises
    there as it does without the monitor (an inference tensor has no version to check).
    """

    __slots__ = ("_version", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = without_history(tensor)
        self._version = None if tensor.is_inference() else tensor._version

    def unpack(self) -> Tensor:
        """The saved tensor, unless it was modified in place since it was saved."""
        tensor, version = self.tensor, self._version
        if version is not None and tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation:"
                f" [{tensor.dtype} {list(tensor.shape)}] is at version {tensor._version}; expected version {version}"
                " instead (checked by lightning_vram's saved-tensor hooks, which stand in for autograd's own check)"
            )
        return tensor


class SavedActivation(SavedTensor):
    """A saved tensor the ledger counts: its storages are released when autograd frees it."""

    __slots__ = ("_keys", "_ledger")

    def __init__(self, tensor: Tensor, ledger: ActivationLedger, keys: tuple[int, ...]) -> None:
        super().__init__(tensor)
        self._ledger = ledger
        self._keys = keys

    def __del__(self) -> None:
        for key in self._keys:
            self._ledger.release(key)


class UnshardedParameters:
    """Parameters FSDP2 all-gathered for a module's forward or backward: whole parameters, alive while gathered.

    Held by their storages: FSDP2 frees an unsharded parameter by resizing its storage to nothing and gathers into
    the same storage again for backward, so :meth:`live_bytes` reads each storage's size now. Holding a storage
    object keeps no data alive once FSDP2 resized it; the ledger lets go of them all at the end of the step.
    """

    def __init__(self) -> None:
        self._storages: dict[int, torch.UntypedStorage] = {}

    def hold(self, tensor: Tensor) -> None:
        """``tensor`` is an unsharded parameter: watch its storage."""
        storage = tensor.untyped_storage()
        self._storages.setdefault(storage_identity(storage), storage)

    @property
    def watching(self) -> bool:
        """Whether any unsharded parameter is watched (none but under FSDP2)."""
        return bool(self._storages)

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is an unsharded parameter's."""
        return bool(self._storages) and storage_identity(storage) in self._storages

    def live_bytes(self) -> int:
        """Bytes of unsharded parameters gathered now."""
        return sum(storage.nbytes() for storage in list(self._storages.values()))

    def clear(self) -> None:
        """Let go of every storage."""
        self._storages.clear()


class ActivationLedger:
    """Live bytes of the storages autograd holds for backward.

    A storage saved several times counts once; it is released when autograd drops its last saved
    reference (node by node during backward). Storages held for backward outside autograd's saving count as well,
    until they are freed (``hold_until_freed``): what a recomputation under activation checkpointing creates, and
    the outputs selective checkpointing keeps from forward. Thread-safe: the autograd engine
    may release from its own threads.

    Parameters FSDP2 gathered (``unsharded``) are not activations, even where autograd saves them: they count
    apart, as ``transient_bytes`` of parameters, and the peak is the highest sum of both, with
    ``peak_live_bytes`` and ``transient_at_peak`` the two parts of it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._references: dict[int, int] = {}
        self._held: set[int] = set()
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.unsharded = UnshardedParameters()
        self.transient_bytes = 0
        self.transient_at_peak = 0
        self._peak_total = 0
        self.saved_bytes_by_module: dict[str, int] = {}

    def _observe_peak(self) -> None:
        if self.live_bytes + self.transient_bytes > self._peak_total:
            self._peak_total = self.live_bytes + self.transient_bytes
            self.peak_live_bytes, self.transient_at_peak = self.live_bytes, self.transient_bytes

    def _add_live(self, key: int, nbytes: int) -> None:
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self._observe_peak()

    def observe_unsharded(self) -> None:
        """Read the unsharded parameters' bytes again (FSDP2 gathers and frees them between the ledger's events)."""
        transient = self.unsharded.live_bytes()
        with self._lock:
            self.transient_bytes = transient
            self._observe_peak()

    def acquire(self, key: int, nbytes: int, module_name: str | None) -> None:
        """Autograd saved a reference to storage ``key`` of ``nbytes`` bytes inside ``module_name``.

        ``None`` for a tensor saved during backward (a reentrant checkpoint's recomputation): it counts as live
        but is not what the module saves in its forward pass.
        """
        with self._lock:
            count = self._references.get(key, 0)
            self._references[key] = count + 1
            if count == 0:
                if key not in self._held:
                    self._add_live(key, nbytes)
                if module_name is not None:
                    by_module = self.saved_bytes_by_module
                    by_module[module_name] = by_module.get(module_name, 0) + nbytes

    def hold_until_freed(self, key: int, nbytes: int, module_name: str | None = None) -> bool:
        """Storage ``key`` of ``nbytes`` bytes is held for backward until it is freed; ``False`` if held already.

        A recomputation created it, or selective checkpointing keeps it from the forward of ``module_name`` (what
        that module saves; ``None``: a recomputation's, saved by no module's forward pass).
        """
        with self._lock:
            if key in self._references or key in self._held:
                return False
            self._held.add(key)
            self._add_live(key, nbytes)
            if module_name is not None:
                self.saved_bytes_by_module[module_name] = self.saved_bytes_by_module.get(module_name, 0) + nbytes
            return True

    def free_held(self, key: int) -> None:
        """Storage ``key`` held until freed (:meth:`hold_until_freed`) was freed (or is no longer watched)."""
        with self._lock:
            if key in self._held:
                self._held.discard(key)
                if key not in self._references:
                    self.live_bytes -= self._sizes.pop(key)

    def start_segment(self) -> None:
        """Start measuring the highest live bytes again from what is live now."""
        with self._lock:
            self.peak_live_bytes, self.transient_at_peak = self.live_bytes, self.transient_bytes
            self._peak_total = self.live_bytes + self.transient_bytes

    def holds(self, key: int) -> bool:
        """Whether autograd holds storage ``key`` for backward now."""
        with self._lock:
            return key in self._references or key in self._held

    def release(self, key: int) -> None:
        """Autograd dropped one saved reference to storage ``key``."""
        with self._lock:
            count = self._references.get(key, 0) - 1
            if count > 0:
                self._references[key] = count
            elif count == 0:
                del self._references[key]
                if key not in self._held:
                    self.live_bytes -= self._sizes.pop(key)


class GradientLedger:
    """Live gradient bytes during backward, and the highest activations + gradients seen together.

    Gradients are kept per parameter, so a gradient that accumulation replaces by a new tensor (a sparse one)
    stops counting when it is replaced.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        activations: ActivationLedger,
        device: torch.device,
        key_of: StorageKey,
        sharded: Iterable[Tensor] = (),
    ) -> None:
        self._device = device
        self._key_of = key_of
        self._activations = activations
        self._by_tensor: dict[int, StorageBytes] = {}
        for parameter in (*module.parameters(), *sharded):  # FSDP2's sharded ones hold the gradients
            gradient = gradient_of(parameter)
            if gradient is not None:
                self._by_tensor[id(parameter)] = self._storages(gradient)
        partitions = StorageBytes()  # ZeRO's gradient partitions, read once at the start of backward
        for optimizer in optimizers:
            for gradient in partition_gradients(optimizer):
                add_storage(partitions, gradient, device, key_of=key_of)
        self._by_tensor[id(self)] = partitions
        self.peak_bytes = -1
        self.gradients_at_peak = 0
        self.activations_at_peak = 0
        self.transient_at_peak = 0
        """FSDP2's unsharded parameters alive at the peak (see :class:`UnshardedParameters`)."""
        self.gradient_bytes = 0
        """Gradient bytes alive at the last :meth:`observe`."""
        self.observe()

    def _storages(self, gradient: Tensor) -> StorageBytes:
        storages = StorageBytes()
        add_storage(storages, gradient, self._device, key_of=self._key_of)
        return storages

    @property
    def uncounted(self) -> set[str]:
        """Kinds of gradient tensors whose data could not be reached."""
        return {kind for storages in self._by_tensor.values() for kind in storages.uncounted}

    def add(self, parameter: Tensor, gradient: Tensor) -> None:
        """``parameter``'s gradient is now ``gradient``."""
        self._by_tensor[id(parameter)] = self._storages(gradient)
        self.observe()

    def observe(self) -> None:
        """Record the current total (bytes) if it is the highest so far."""
        unique: dict[int, int] = {}
        for storages in self._by_tensor.values():
            unique.update(storages)
        gradient_bytes = self.gradient_bytes = sum(unique.values())
        activation_bytes, transient = self._activations.live_bytes, self._activations.transient_bytes
        if gradient_bytes + activation_bytes + transient > self.peak_bytes:
            self.peak_bytes = gradient_bytes + activation_bytes + transient
            self.gradients_at_peak = gradient_bytes
            self.activations_at_peak = activation_bytes
            self.transient_at_peak = transient
