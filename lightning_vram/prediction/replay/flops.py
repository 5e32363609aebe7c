"""The FLOPs of a replayed step, counted from the ops the replay's live count already sees.

torch's ``FlopCounterMode`` is a dispatch mode of its own, and it changes the step it counts: an op without a FLOP
formula is decomposed where it can be (CPU flash attention, ``_scaled_dot_product_flash_attention_for_cpu``, becomes
its math ops, which save more for backward: a BERT-style replay's backward peak rose 4%), and its module tracker's
gradient hooks held gradients longer (a checkpointed ResNet's backward peak rose 28.6 KiB). :class:`StepFlops`
runs no mode of its own: the live count (:class:`~lightning_vram.prediction.replay.live.LiveMemory`) hands it each op
as it ran, and it adds torch's own formula for it (``torch.utils.flop_counter.flop_registry``; CPU flash attention by
torch's attention formulas), so every memory figure of the replay stays as it was.

Beside the FLOPs it counts each op's bytes moved (its tensor inputs read and outputs written: a roofline's memory
traffic; a broadcast input is read once, its storage's bytes where they are fewer than its elements'), the ops
themselves, the phase each ran in (as a :class:`~lightning_vram.prediction.replay.live.Sampler` it is told of each
phase's start) and whether activation checkpointing recomputed it (a module's forward running in the backward
phase): :meth:`StepFlops.work`, what a step time is predicted from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from lightning_vram.measure.tensors import op_tensors
from lightning_vram.prediction.replay.ops import op_name
from lightning_vram.records import Phase, StepWork
from lightning_vram.records.work import OpKey, grouped

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_UNSAFE_VIEW = torch.ops.aten._unsafe_view
_DTYPE_CLASSES: dict[torch.dtype | None, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}


class StepFlops:
    """The step's total FLOPs (:meth:`get_total_flops`) and its ops' work (:meth:`work`), from every op it is handed.

    ``recomputing`` tells whether a module's forward runs now (the replay's counter's ``current_module``): in the
    backward phase, that is activation checkpointing's recomputation. Ops before the first phase starts count
    under the forward phase.
    """

    def __init__(self, recomputing: Callable[[], bool] | None = None) -> None:
        self._total = 0
        self._recomputing = recomputing
        self._phase = Phase.FORWARD
        self._ops: list[OpKey] = []

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts now: the ops from here on are its."""
        self._phase = phase

    def sample(self, op: str) -> None:
        """An op ran (counted already by :meth:`count`, which the live count calls first)."""

    def count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Add the FLOPs, bytes and op of one op that ran (``func`` on ``args`` and ``kwargs``, giving ``output``).

        FLOPs only where torch has a formula for it: an op without one (elementwise, copies) adds none, as in
        ``FlopCounterMode``; it still moves bytes. A query of a tensor's metadata is not counted.
        """
        if _metadata(func):
            return
        flops = self._flops(func, args, kwargs, output)
        self._total += flops
        view = bool(getattr(func, "is_view", False)) or getattr(func, "_overloadpacket", None) is _UNSAFE_VIEW
        inputs = op_tensors((args, kwargs))
        outputs = op_tensors(output)
        moved = 0 if view else sum(_bytes(tensor) for tensor in (*inputs, *outputs))
        dtype = next(
            (_DTYPE_CLASSES.get(tensor.dtype, "other") for tensor in inputs if tensor.is_floating_point()), "other"
        )
        recomputed = self._phase is Phase.BACKWARD and self._recomputing is not None and self._recomputing()
        self._ops.append((self._phase, dtype, flops, moved, recomputed, view, op_name(func)))

    @staticmethod
    def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> int:
        packet = getattr(func, "_overloadpacket", None)
        if packet is _CPU_FLASH:
            query, key, value = args[:3]
            return int(sdpa_flop_count(query.shape, key.shape, value.shape))  # type: ignore[no-untyped-call]
        if packet is _CPU_FLASH_BACKWARD:
            gradient, query, key, value = args[:4]
            return int(
                sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
                    gradient.shape, query.shape, key.shape, value.shape
                )
            )
        if packet in flop_registry:
            return int(flop_registry[packet](*args, **kwargs, out_val=output))
        return 0

    def get_total_flops(self) -> int:
        """FLOPs counted so far (multiply-adds count 2, as in torch's formulas)."""
        return self._total

    def work(self) -> StepWork:
        """Every op counted so far, grouped: FLOPs, bytes moved, phase, dtype, recomputed or not."""
        return grouped(self._ops)


_METADATA_RETURNS = frozenset({"int", "SymInt", "bool", "Device", "ScalarType", "Layout", "int[]", "SymInt[]"})
"""Return types of an op that only reads a tensor's metadata."""


_METADATA: dict[Any, bool] = {}
"""Each op met: whether it only reads metadata (:func:`_metadata`, worked out once per op)."""


def _metadata(func: Any) -> bool:
    """Whether ``func`` only reads tensors' metadata (``prim.device``, ``aten.sym_size``): no kernel, not an op.

    Under fake tensors such queries are dispatched (eager tensors answer them without dispatch).

    >>> _metadata(torch.ops.prim.device.default), _metadata(torch.ops.aten.sym_size.int)
    (True, True)
    >>> _metadata(torch.ops.aten._local_scalar_dense.default), _metadata(torch.ops.aten._foreach_add_.Scalar)
    (False, False)
    """
    known = _METADATA.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = getattr(func, "namespace", None) == "prim" or (
            schema is not None
            and not schema.is_mutable
            and bool(schema.returns)
            and all(str(returned.type) in _METADATA_RETURNS for returned in schema.returns)
        )
        _METADATA[func] = known
    return known


def _bytes(tensor: Tensor) -> int:
    """Bytes an op reads or writes of ``tensor``: its elements', or its storage's where fewer (a broadcast)."""
    elements = tensor.numel() * tensor.element_size()
    try:
        return min(elements, tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a sparse layout)
        return elements
