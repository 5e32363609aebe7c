"""DeepSpeed ZeRO's partitions: the tensors a rank holds outside ``param.data``, ``param.grad`` and ``optimizer.state``.

Read by attribute where present (checked against DeepSpeed 0.19), so deepspeed is never imported:

- ZeRO-3 partitions every parameter: between uses ``param.data`` is empty and this rank's slice of it lives in
  ``param.ds_tensor``.
- The ZeRO optimizer (stages 1 to 3) wraps the user's optimizer (``.optimizer``). It keeps an fp32 master copy of
  this rank's partition, counted as optimizer state as in the ZeRO paper: ``single_partition_of_fp32_groups``
  (stages 1 and 2), ``fp32_partitioned_groups_flat`` (stage 3). The gradients of the partition are gradients:
  ``averaged_gradients`` between backward and the step (stages 1 and 2), ``grad_partitions_flat_buffer`` for the
  whole run (stage 3). During backward ``param.grad`` is a view of the reduction bucket (``reduce_bucket_size``
  elements) or the whole gradient (stage 1) until DeepSpeed moves it into the partition; the gradient hooks count
  that storage whole.

Tensors offloaded to the CPU (ZeRO-Offload) are not on the monitored GPU and so are not counted; parameters gathered
for a layer's forward or backward are temporaries of the allocator, reported in ``other``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_vram.measure.tensors import iter_tensors

MASTER_WEIGHT_ATTRIBUTES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
"""ZeRO optimizer attributes holding the fp32 master copy of this rank's partition."""

GRADIENT_ATTRIBUTES = ("averaged_gradients", "grad_partitions_flat_buffer")
"""ZeRO optimizer attributes holding the gradients of this rank's partition."""


def _attribute_tensors(optimizer: torch.optim.Optimizer, names: tuple[str, ...]) -> Iterator[Tensor]:
    for name in names:
        yield from iter_tensors(getattr(optimizer, name, None))


def parameter_partition(parameter: Tensor) -> Tensor | None:
    """The ZeRO-3 slice of ``parameter`` this rank holds (``ds_tensor``), or ``None`` where ZeRO-3 does not own it."""
    partition = getattr(parameter, "ds_tensor", None)
    return partition if isinstance(partition, Tensor) else None


def full_numel(parameter: Tensor) -> int:
    """Elements of the whole parameter, also while ZeRO-3 has it partitioned (``numel()`` is then 0)."""
    numel = getattr(parameter, "ds_numel", None)
    return numel if isinstance(numel, int) else parameter.numel()


def master_weights(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The fp32 master copy of this rank's partition, held by a ZeRO optimizer (nothing for any other optimizer)."""
    return _attribute_tensors(optimizer, MASTER_WEIGHT_ATTRIBUTES)


def partition_gradients(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The gradients of this rank's partition, held by a ZeRO optimizer (nothing for any other optimizer)."""
    return _attribute_tensors(optimizer, GRADIENT_ATTRIBUTES)


def wrapped_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer inside a ZeRO optimizer (which names it ``.optimizer``), else ``optimizer`` itself."""
    if any(hasattr(optimizer, name) for name in MASTER_WEIGHT_ATTRIBUTES):
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the module's whole parameters in their dtypes, whether or not ZeRO-3 has them partitioned.

    Uninitialised parameters (``nn.LazyLinear`` before its first forward) have no size yet and count 0.
    """
    return sum(
        full_numel(parameter) * parameter.element_size() for parameter in module.parameters() if not is_lazy(parameter)
    )
