"""Storages of tensors on the monitored device, each counted once, for real and fake tensors alike.

A count is a :class:`StorageBytes`: storage key -> storage size in bytes. A step's count (sampled or replayed)
knows a storage by the address of its C++ storage object (:func:`weak_identity`, through ``StorageWeakRef``), real or
fake (a fake one has no data pointer), unique while the storage lives. Its data pointer (:data:`DATA_POINTER`) is not:
a storage whose data is freed while the storage lives (``resize_(0)``, as FSDP1 frees a gathered flat parameter that
autograd saved a view of) leaves its address to the next allocation, which a count by address takes for it. Data
pointers serve counts made at one moment, of storages all alive then. A key of 0 means the storage holds nothing (an
empty one) and is not counted.

Only tensors on the monitored device count, so views, tied weights and Adam's CPU ``step`` counters on a GPU run
are not counted twice or at all. Sharded tensors count as the shard this rank holds: a DTensor's local tensor
(FSDP2), FSDP1's flat parameter shard (its parameters are views of it), DeepSpeed ZeRO's partitions (see
``deepspeed_zero``). Tensors without one dense storage count by the storages that hold their data: a sparse tensor
its indices and values, a tensor subclass that flattens (``__tensor_flatten__``) its inner tensors. Uninitialised
parameters (``nn.LazyLinear`` before its first forward) hold nothing yet. A tensor whose data cannot be reached at
all (an opaque MKL-DNN tensor) is skipped and its kind noted in :attr:`StorageBytes.uncounted`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parameter import is_lazy

from lightning_vram.measure.deepspeed_zero import master_weights, parameter_partition, partition_gradients
from lightning_vram.measure.tensors import iter_tensors

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class StorageBytes(dict[int, int]):
    """Storage key -> storage size in bytes, and the kinds of tensors met whose data could not be reached."""

    def __init__(self) -> None:
        super().__init__()
        self.uncounted: set[str] = set()
        """Kinds of tensors skipped (``tensor_kind``): they have no storage the counting can read."""


StorageKey = Callable[[torch.UntypedStorage], int]
"""How a caller identifies a storage: its ``StorageWeakRef`` identity (a step's count), or its data pointer."""
DATA_POINTER: StorageKey = torch.UntypedStorage.data_ptr
"""A real storage's address (0 for an empty one), read by torch's own method: a key for storages all alive at once
(freed data's address is reused by the next allocation, the storage alive or not)."""


def storage_identity(storage: torch.UntypedStorage) -> int:
    """The identity of a storage, real or fake, empty or not: the address of its C++ object."""
    return int(StorageWeakRef(storage).cdata)  # type: ignore[no-untyped-call]  # torch ships it unannotated


def storage_key(tensor: Tensor) -> int:
    """The identity of ``tensor``'s storage (:func:`storage_identity`): the same for every view of it."""
    return storage_identity(tensor.untyped_storage())


def weak_identity(storage: torch.UntypedStorage) -> int:
    """The counting key of a storage that may be fake: :func:`storage_identity`, or 0 for an empty storage.

    >>> weak_identity(torch.zeros(0).untyped_storage())
    0
    """
    return storage_identity(storage) if storage.nbytes() else 0


def _dtensor_type() -> type[DTensor] | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


DTENSOR = _dtensor_type()
"""``torch.distributed.tensor.DTensor`` (FSDP2 and tensor-parallel parameters), or ``None`` without distributed."""


def _fsdp_module_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


FSDP_MODULE = _fsdp_module_type()
"""``torch.distributed.fsdp.FSDPModule`` (what ``fully_shard`` makes a module), or ``None`` without distributed."""


def gradient_of(tensor: Tensor) -> Tensor | None:
    """``tensor.grad`` for a leaf tensor (a parameter), ``None`` for any other.

    A module's "parameters" are not always leaves: FSDP (``use_orig_params=True``) stands views of its flat parameter
    in for them while the module runs, and torch warns on reading a non-leaf tensor's ``.grad`` (seen on an H100 as
    a warning out of the monitor's sampled step). A non-leaf tensor holds no parameter's gradient.
    """
    return tensor.grad if tensor.is_leaf else None


def unsharded_parameters(module: nn.Module) -> list[Tensor]:
    """The parameters FSDP2 has all-gathered for ``module`` now: none unless it is a ``fully_shard`` module.

    While an FSDP2 module runs its forward or backward, its registered parameters are the unsharded ones (plain
    tensors, the whole parameter); the rest of the time they are the sharded DTensors.
    """
    if FSDP_MODULE is None or not isinstance(module, FSDP_MODULE):
        return []
    return [parameter for parameter in module.parameters() if DTENSOR is None or not isinstance(parameter, DTENSOR)]


def local_tensor(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, any other tensor itself.

    The shard itself (``_local_tensor``, the storage ``to_local()`` views), not ``to_local()``: that runs an autograd
    function and a ``view_as`` through every dispatch mode, for each DTensor counted (a fifth of an FSDP2 replay).
    """
    if DTENSOR is not None and isinstance(tensor, DTENSOR):
        local = getattr(tensor, "_local_tensor", None)
        if isinstance(local, Tensor):
            return local
        shard: Tensor = tensor.to_local()  # another torch, without the attribute
        return shard
    return tensor


def on_device(tensor: Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on ``device`` (an index-less device matches any index of its type)."""
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


SPARSE_COMPONENTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),  # the public indices() refuses the uncoalesced gradients of Embedding
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
"""The methods giving a sparse tensor's dense components, by layout."""


def tensor_storages(tensor: Tensor) -> list[torch.UntypedStorage] | None:
    """The storages holding ``tensor``'s data, or ``None`` where they cannot be reached.

    A dense tensor has one; a sparse one the storages of its indices and values; a tensor subclass that
    flattens (``__tensor_flatten__``: DTensor, jagged nested tensors) those of its inner tensors. An
    uninitialised parameter has none yet.

    >>> dense = torch.zeros(4, 4)
    >>> [storage.nbytes() for storage in tensor_storages(dense)]
    [64]
    >>> [storage.nbytes() for storage in tensor_storages(torch.eye(3).to_sparse())]  # 2 x 3 int64, 3 float32
    [48, 12]
    """
    if is_lazy(tensor):
        return []
    components = SPARSE_COMPONENTS.get(tensor.layout)
    if components is not None:
        return [getattr(tensor, name)().untyped_storage() for name in components]
    if type(tensor) is not Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _context = tensor.__tensor_flatten__()
        storages: list[torch.UntypedStorage] = []
        for name in names:
            inner = getattr(tensor, name, None)
            found = tensor_storages(inner) if isinstance(inner, Tensor) else []
            if found is None:
                return None
            storages += found
        return storages
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # an opaque tensor (MKL-DNN) or a subclass without real storage
        return None


def tensor_kind(tensor: Tensor) -> str:
    """How the report names a kind of tensor: its class and layout.

    >>> tensor_kind(torch.eye(2).to_sparse())
    'Tensor (torch.sparse_coo)'
    """
    return f"{type(tensor).__name__} ({tensor.layout})"


def add_storage(
    storages: StorageBytes,
    tensor: Tensor,
    device: torch.device,
    exclude: Iterable[int] = (),
    key_of: StorageKey = DATA_POINTER,
) -> None:
    """Add ``tensor``'s storages (a DTensor's local shard), keyed by ``key_of``, unless elsewhere, empty or excluded.

    A tensor whose data cannot be reached is noted in ``storages.uncounted`` instead.
    """
    tensor = local_tensor(tensor)
    if not on_device(tensor, device):
        return
    found = tensor_storages(tensor)
    if found is None:
        storages.uncounted.add(tensor_kind(tensor))
        return
    for storage in found:
        key = key_of(storage)
        if key and key not in exclude:
            storages[key] = storage.nbytes()


def storage_bytes(value: Any, device: torch.device, key_of: StorageKey = DATA_POINTER) -> StorageBytes:
    """Unique storages of every tensor inside ``value`` (nested containers) on ``device``."""
    storages = StorageBytes()
    for tensor in iter_tensors(value):
        add_storage(storages, tensor, device, key_of=key_of)
    return storages


def parameter_storages(module: nn.Module, device: torch.device, key_of: StorageKey = DATA_POINTER) -> StorageBytes:
    """Storages of the module's parameters on ``device`` (tied weights once), with ZeRO-3's partitions."""
    storages = StorageBytes()
    for parameter in module.parameters():
        add_storage(storages, parameter, device, key_of=key_of)
        partition = parameter_partition(parameter)
        if partition is not None:
            add_storage(storages, partition, device, key_of=key_of)
    return storages


def gradient_storages(
    module: nn.Module,
    device: torch.device,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    key_of: StorageKey = DATA_POINTER,
    sharded: Iterable[Tensor] = (),
) -> StorageBytes:
    """Storages of the gradients alive now: on the module's parameters, and in ZeRO optimizers' partitions.

    ``sharded`` are parameters the module may not show now: FSDP2's sharded parameters, which hold the gradients,
    are swapped out of the module while it runs unsharded.
    """
    storages = StorageBytes()
    for parameter in (*module.parameters(), *sharded):
        gradient = gradient_of(parameter)
        if gradient is not None:
            add_storage(storages, gradient, device, key_of=key_of)
    for optimizer in optimizers:
        for gradient in partition_gradients(optimizer):
            add_storage(storages, gradient, device, key_of=key_of)
    return storages


def optimizer_state_storages(
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    exclude: Iterable[int],
    key_of: StorageKey = DATA_POINTER,
) -> StorageBytes:
    """Storages of every optimizer's state on ``device``, minus those in ``exclude`` (parameters, gradients).

    A ZeRO optimizer's state includes its fp32 master copy of this rank's partition.
    """
    excluded = set(exclude)
    storages = StorageBytes()
    for optimizer in optimizers:
        for tensor in iter_tensors(list(optimizer.state.values())):
            add_storage(storages, tensor, device, excluded, key_of)
        for tensor in master_weights(optimizer):
            add_storage(storages, tensor, device, excluded, key_of)
    return storages


def model_state_storages(
    module: nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    key_of: StorageKey = DATA_POINTER,
    sharded: Iterable[Tensor] = (),
) -> tuple[StorageBytes, StorageBytes, StorageBytes]:
    """(parameter, gradient, optimizer-state) storages alive now on ``device``, each storage in one of them.

    ``sharded``: FSDP2's sharded parameters, whose gradients count while the module runs unsharded.
    """
    optimizers = list(optimizers)
    parameters = parameter_storages(module, device, key_of)
    gradients = gradient_storages(module, device, optimizers, key_of, sharded)
    state = optimizer_state_storages(optimizers, device, set(parameters) | set(gradients), key_of)
    return parameters, gradients, state


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes alive now on ``device``, each storage counted once."""
    parameters, gradients, state = model_state_storages(module, optimizers, device)
    return sum(parameters.values()), sum(gradients.values()), sum(state.values())
