"""FSDP1's gathered flat parameters: the storages ``FullyShardedDataParallel`` all-gathers each unit into.

Under a sharding strategy (``FULL_SHARD``, ``SHARD_GRAD_OP``) a unit's flat parameter holds this rank's shard between
uses; FSDP1 all-gathers it into one storage of the unit's (``_full_param_padded``; under mixed precision the
low-precision copy ``_mp_shard`` and the full-precision ``_full_prec_full_param_padded`` too), allocated once when
FSDP1 initialises (its lazy init, at the first forward) and freed by ``resize_(0)`` after use: after the unit's
forward under ``FULL_SHARD`` (the root's after backward), gathered again for its backward; after backward under
``SHARD_GRAD_OP``. While the unit runs its parameters are views of that storage, so autograd saves views of it: a
storage whose bytes are not held between forward and backward (its size is 0 then), the unit's parameters, not an
activation. :class:`GatheredFlatParameters` tells a sampled step's count which storages those are, by identity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_vram.measure.storages import storage_identity

GATHERED = ("_full_param_padded", "_full_prec_full_param_padded", "_mp_shard")
"""A flat parameter's attributes holding a storage FSDP1 gathers or copies the unit's parameters into (torch 2.13
``torch/distributed/fsdp/_flat_param.py``: ``FlatParamHandle.init_flat_param_attributes``)."""


def fsdp1_wrappers(module: nn.Module) -> list[nn.Module]:
    """Each ``FullyShardedDataParallel`` (FSDP1) wrapper under ``module`` (itself included), outermost first."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [child for child in module.modules() if isinstance(child, FullyShardedDataParallel)]


def flat_parameters(module: nn.Module) -> list[Any]:
    """FSDP1's flat parameters of ``module``: its wrappers' (``use_orig_params=True`` too), then any registered one.

    Each once, outermost wrapper's first; the root's flat parameter where the root wrapper is outside ``module``
    (Lightning's ``fsdp`` strategy wraps the LightningModule itself) is found among its parameters.
    """
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp._flat_param import FlatParameter

    found: dict[int, Any] = {}
    for wrapper in fsdp1_wrappers(module):
        handle = getattr(wrapper, "_handle", None)
        if handle is not None:
            found.setdefault(id(handle.flat_param), handle.flat_param)
    for parameter in module.parameters():
        if isinstance(parameter, FlatParameter):
            found.setdefault(id(parameter), parameter)
    return list(found.values())


class GatheredFlatParameters:
    """The storages FSDP1 gathers ``module``'s units into (see the module's docstring), by ``StorageWeakRef`` identity.

    Read from the flat parameters' attributes, never changed; read again at each question until FSDP1 has initialised
    every flat parameter (``_local_shard`` set), once for all after.
    """

    def __init__(self, module: nn.Module) -> None:
        self._flats = flat_parameters(module)
        self._identities: frozenset[int] | None = None if self._flats else frozenset()

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is one FSDP1 gathers a unit's parameters into."""
        identities = self._identities if self._identities is not None else self._read()
        return bool(identities) and storage_identity(storage) in identities

    def _read(self) -> frozenset[int]:
        found = frozenset(
            storage_identity(gathered.untyped_storage())
            for flat in self._flats
            for name in GATHERED
            if isinstance(gathered := getattr(flat, name, None), Tensor)
        )
        if all(hasattr(flat, "_local_shard") for flat in self._flats):
            self._identities = found
        return found
