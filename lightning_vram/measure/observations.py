"""What each module did with its inputs and outputs during a sampled forward pass, for the advice rules.

- Which of a module's input and output storages it (or its submodules) saved for backward during its call: a
  checkpointing plan needs it to tell which storages a unit keeps and which its neighbours keep.
- Whether autograd held an activation module's output for backward when the forward pass ended (saved by it or
  by a later op): making it inplace then merges its input and output into one saved tensor.
- The convolutional feature map a ``Linear`` read flattened: the output of a Conv, Pool or BatchNorm layer with
  more than one spatial position, carried through shape-keeping modules (activations, dropout, ``Flatten``). Global
  average pooling is a remedy for that Linear's size only then.

Storages are identified by address while they are alive (``StorageWeakRef``), so a freed address that a later
tensor reuses is never taken for the tensor that lived there.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_vram.measure.storages import DATA_POINTER, StorageKey
from lightning_vram.measure.tensors import iter_tensors

FEATURE_MAP_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.LPPool1d,
    nn.LPPool2d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
)
"""Layers whose output ``(batch, channels, *positions)`` is a convolutional feature map."""


@dataclass
class ModuleFacts:
    """What one module did during the sampled forward pass, summed over its calls (bytes).

    ``input_saved_bytes`` / ``output_saved_bytes``: its input / output storages that it or its submodules saved
    for backward during the call. ``output_saved_for_backward``: autograd held its output when the forward pass
    ended (watched for activation modules only). ``input_feature_map``: ``(channels, positions)`` of the
    convolutional feature map a ``Linear`` read flattened, else ``None``; ``input_feature_map_dims``: that map's
    dimensions past its channels (1 for ``Conv1d``'s ``(B, C, L)``, 2 for an image's, 3 for a volume's).
    """

    input_saved_bytes: int = 0
    output_saved_bytes: int = 0
    output_saved_for_backward: bool = False
    input_feature_map: tuple[int, int] | None = None
    input_feature_map_dims: int | None = None


@dataclass
class _Call:
    """One module call in progress: its input storages (address -> bytes) and what was saved during it."""

    label: str
    inputs: dict[int, int]
    first_input: tuple[int, int] | None
    saved: set[int] = field(default_factory=set)


class _Alive:
    """Whether a storage is still allocated, without keeping it alive."""

    __slots__ = ("_reference",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._reference = StorageWeakRef(storage)  # type: ignore[no-untyped-call]  # torch ships it unannotated

    def __bool__(self) -> bool:
        expired: bool = self._reference.expired()  # type: ignore[no-untyped-call]
        return not expired


def _storage_key(tensor: Tensor, key_of: StorageKey) -> tuple[int, _Alive] | None:
    """The key of ``tensor``'s dense storage and a weak check that it lives, or ``None`` without one."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse and opaque tensors: no feature maps there
        return None
    if not storage.nbytes():
        return None
    key = key_of(storage)
    return (key, _Alive(storage)) if key else None


def stored_attribute(module: object, name: str) -> object | None:
    """The plain value ``module`` (or any object) stores under ``name`` (its own or its class's), without running code.

    ``inspect.getattr_static`` reads the instance and class dictionaries as they are: a property, a ``__getattr__``
    or any other descriptor is never run (a user's module may compute anything there), and reads as ``None``, as
    does a name that is not stored. Torch's modules store their constructor arguments (``inplace``,
    ``in_features``, ``negative_slope``) as plain instance attributes.

    >>> stored_attribute(nn.ReLU(), "inplace"), stored_attribute(nn.Linear(3, 2), "in_features")
    (False, 3)
    >>> stored_attribute(nn.Linear(3, 2), "weight") is None  # in ``_parameters``: nn.Module.__getattr__ finds it
    True
    """
    try:
        value = inspect.getattr_static(module, name)
    except AttributeError:
        return None
    return None if hasattr(type(value), "__get__") else value


def _first_tensor(value: Any) -> Tensor | None:
    found: Iterator[Tensor] = iter_tensors(value)
    return next(found, None)


class ModuleObserver:
    """Collects :class:`ModuleFacts` while a sampled forward pass runs; call in the module hooks' order.

    ``key_of`` identifies storages the way the caller's keys (``inputs``, :meth:`saved`) do.
    """

    def __init__(self, key_of: StorageKey = DATA_POINTER) -> None:
        self._key_of = key_of
        self._calls: list[_Call] = []
        self._facts: dict[str, ModuleFacts] = {}
        self._feature_maps: dict[int, tuple[_Alive, int, int, int]] = {}
        self._watched_outputs: list[tuple[str, int, _Alive]] = []

    def facts(self, label: str) -> ModuleFacts:
        """What module ``label`` did (all defaults when it was never observed)."""
        return self._facts.get(label, ModuleFacts())

    def enter(self, label: str, module: nn.Module, args: Any, inputs: dict[int, int]) -> None:
        """Module ``label`` is called with ``args``, whose storages are ``inputs`` (address -> bytes)."""
        first = _first_tensor(args)
        first_input = None
        if first is not None:
            found = _storage_key(first, self._key_of)
            if found is not None:
                first_input = (found[0], first.numel())
                if isinstance(module, nn.Linear) and first.dim() == 2:
                    self._note_flattened_map(label, module, found[0])
        self._calls.append(_Call(label, dict(inputs), first_input))

    def _note_flattened_map(self, label: str, linear: nn.Linear, key: int) -> None:
        known = self._feature_maps.get(key)
        if known is None or not known[0]:
            return
        _, channels, positions, dims = known
        if channels * positions == stored_attribute(linear, "in_features"):
            facts = self._facts.setdefault(label, ModuleFacts())
            facts.input_feature_map = (channels, positions)
            facts.input_feature_map_dims = dims

    def saved(self, key: int) -> None:
        """Autograd saved storage ``key`` for backward inside the innermost module call."""
        if self._calls:
            self._calls[-1].saved.add(key)

    def leave(
        self, label: str, module: nn.Module, output: Any, outputs: dict[int, int], watch_output: bool = False
    ) -> None:
        """Module ``label`` returned ``output``, whose storages are ``outputs``; the innermost call ends."""
        if not self._calls or self._calls[-1].label != label:
            return
        call = self._calls.pop()
        facts = self._facts.setdefault(label, ModuleFacts())
        facts.input_saved_bytes += sum(nbytes for key, nbytes in call.inputs.items() if key in call.saved)
        facts.output_saved_bytes += sum(nbytes for key, nbytes in outputs.items() if key in call.saved)
        if self._calls:
            self._calls[-1].saved |= call.saved
        first = _first_tensor(output)
        found = _storage_key(first, self._key_of) if first is not None else None
        if first is None or found is None:
            return
        if watch_output:
            self._watched_outputs.append((label, *found))
        self._note_feature_map(module, first, found, call.first_input)

    def _note_feature_map(
        self, module: nn.Module, output: Tensor, found: tuple[int, _Alive], first_input: tuple[int, int] | None
    ) -> None:
        key, reference = found
        if isinstance(module, FEATURE_MAP_LAYERS) and output.dim() >= 3:
            self._feature_maps[key] = (reference, output.shape[1], math.prod(output.shape[2:]), output.dim() - 2)
            return
        if first_input is None:
            return
        input_key, input_numel = first_input
        known = self._feature_maps.get(input_key)
        if known is not None and known[0] and output.numel() == input_numel:
            self._feature_maps[key] = (reference, *known[1:])  # same map: activation, dropout, flatten

    def forward_ended(self, holds: Callable[[int], bool]) -> None:
        """The forward pass ended: note which watched outputs autograd holds now (``holds(address)``)."""
        for label, key, reference in self._watched_outputs:
            if reference and holds(key):
                self._facts.setdefault(label, ModuleFacts()).output_saved_for_backward = True
        self._watched_outputs.clear()
        self._feature_maps.clear()
        self._calls.clear()
