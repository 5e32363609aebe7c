"""Storage identity and sizes that hold for fake tensors as well as real ones.

A fake tensor's storage has no data pointer, so the monitor's key (``data_ptr()``) cannot tell two fake storages
apart. Here a storage is known by the address of its C++ storage object (``StorageWeakRef(...).cdata``), which is
unique for as long as the storage lives, for real and fake tensors alike. The counting rules are the monitor's
(:mod:`lightning_vram.measure.accounting`): each storage once, on the counted device only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_vram.measure.accounting import on_device
from lightning_vram.measure.tensors import iter_tensors

ALLOCATOR_BLOCK_BYTES = 512
"""The CUDA caching allocator hands out blocks in multiples of 512 bytes (its ``kMinBlockSize``)."""

StorageBytes = dict[int, int]
"""Storage key (see :func:`storage_key`) -> storage size in bytes."""


def storage_key(tensor: Tensor) -> int:
    """The identity of ``tensor``'s storage: the same for every view of it, for real and fake tensors."""
    return storage_identity(tensor.untyped_storage())


def storage_identity(storage: torch.UntypedStorage) -> int:
    """The identity of a storage, real or fake: the address of its C++ object."""
    return int(StorageWeakRef(storage).cdata)  # type: ignore[no-untyped-call]  # torch ships it unannotated


def allocator_bytes(nbytes: int) -> int:
    """The bytes the CUDA caching allocator reserves for a tensor of ``nbytes``: whole 512-byte blocks.

    >>> allocator_bytes(0), allocator_bytes(1), allocator_bytes(512), allocator_bytes(513)
    (0, 512, 512, 1024)
    """
    return -(-nbytes // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES


def add_storage(storages: StorageBytes, tensor: Tensor, device: torch.device, exclude: Iterable[int] = ()) -> None:
    """Add ``tensor``'s storage unless it lives elsewhere, is empty, or is in ``exclude``."""
    if not on_device(tensor, device):
        return
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    key = storage_key(tensor)
    if nbytes and key not in exclude:
        storages[key] = nbytes


def parameter_storages(module: nn.Module, device: torch.device) -> StorageBytes:
    """Storages of the module's parameters on ``device`` (tied weights once)."""
    storages: StorageBytes = {}
    for parameter in module.parameters():
        add_storage(storages, parameter, device)
    return storages


def gradient_storages(module: nn.Module, device: torch.device) -> StorageBytes:
    """Storages of the gradients alive now on the module's parameters."""
    storages: StorageBytes = {}
    for parameter in module.parameters():
        if parameter.grad is not None:
            add_storage(storages, parameter.grad, device)
    return storages


def optimizer_state_storages(
    optimizers: Iterable[torch.optim.Optimizer], device: torch.device, exclude: Iterable[int]
) -> StorageBytes:
    """Storages of every optimizer's state on ``device``, minus those in ``exclude`` (parameters, gradients)."""
    excluded = set(exclude)
    storages: StorageBytes = {}
    for optimizer in optimizers:
        for tensor in iter_tensors(list(optimizer.state.values())):
            add_storage(storages, tensor, device, excluded)
    return storages


def storage_bytes(value: object, device: torch.device) -> StorageBytes:
    """Unique storages of every tensor inside ``value`` (nested containers) on ``device``."""
    storages: StorageBytes = {}
    for tensor in iter_tensors(value):
        add_storage(storages, tensor, device)
    return storages
