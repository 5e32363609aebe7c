"""The FLOPs of a replayed step, counted from the ops the replay's live count already sees.

torch's ``FlopCounterMode`` is a dispatch mode of its own, and it changes the step it counts: an op without a FLOP
formula is decomposed where it can be (CPU flash attention, ``_scaled_dot_product_flash_attention_for_cpu``, becomes
its math ops, which save more for backward: a BERT-style replay's backward peak rose 4%), and its module tracker's
gradient hooks held gradients longer (a checkpointed ResNet's backward peak rose 28.6 KiB). :class:`StepFlops`
runs no mode of its own: the live count (:class:`~lightning_vram.prediction.replay.live.LiveMemory`) hands it each op
as it ran, and it adds torch's own formula for it (``torch.utils.flop_counter.flop_registry``; CPU flash attention by
torch's attention formulas), so every memory figure of the replay stays as it was.

Attention (scaled dot product, every kernel: CPU flash, CUDA flash, memory-efficient, cuDNN) is counted by
:func:`attention_flops` and :func:`attention_backward_flops`, torch's formulas with grouped-query attention's key/value
heads broadcast to the query's: torch before 2.13 asserted that key and value have as many heads as the query, and
failed the replay of every grouped-query model (Llama, Mistral, Qwen2 with ``enable_gqa``). A formula that fails on an
op (torch's, or one registered with ``register_flop_formula``) leaves that op's FLOPs uncounted, and
:attr:`StepFlops.notes` says so: one op's FLOPs never fail the step's memory replay. The fused recurrent kernels
(``nn.LSTM`` on the CPU, ``nn.LSTM``/``nn.GRU``/``nn.RNN`` on cuDNN), which torch has no formula for (its
``FlopCounterMode`` counts an LSTM as 0 FLOPs), are counted by :mod:`~lightning_vram.prediction.replay.rnn_flops`
as torch counts the same recurrence written as matrix products.

Beside the FLOPs it counts each op's bytes moved (its tensor inputs read and outputs written: a roofline's memory
traffic; a broadcast input is read once, its storage's bytes where they are fewer than its elements'), the ops
themselves, the phase each ran in (as a :class:`~lightning_vram.prediction.replay.live.Sampler` it is told of each
phase's start) and whether activation checkpointing recomputed it (a module's forward running in the backward
phase): :meth:`StepFlops.work`, what a step time is predicted from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import flop_registry

from lightning_vram.measure.tensors import op_tensors
from lightning_vram.prediction.containment.containment import ContainmentError
from lightning_vram.prediction.containment.deadline import ReplayDeadlineError
from lightning_vram.prediction.replay.ops import op_name
from lightning_vram.prediction.replay.rnn_flops import RECURRENT_FORMULAS
from lightning_vram.records import Phase, StepWork
from lightning_vram.records.work import OpKey, grouped

_UNSAFE_VIEW = torch.ops.aten._unsafe_view


def _packets(*names: str) -> frozenset[Any]:
    """The ops of ``names`` this torch has (``_scaled_dot_product_cudnn_attention`` came in torch 2.3)."""
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


_ATTENTION = _packets(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""Scaled dot product attention's kernels: ``(query, key, value, ...)``, each ``(batch, heads, length, head_dim)``."""

_ATTENTION_BACKWARD = _packets(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)
"""Their backward kernels: ``(grad_out, query, key, value, ...)``."""

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
        self._failed: dict[str, str] = {}

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts now: the ops from here on are its."""
        self._phase = phase

    def sample(self, op: str) -> None:
        """An op ran (counted already by :meth:`count`, which the live count calls first)."""

    def count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Add the FLOPs, bytes and op of one op that ran (``func`` on ``args`` and ``kwargs``, giving ``output``).

        FLOPs only where torch has a formula for it: an op without one (elementwise, copies) adds none, as in
        ``FlopCounterMode``; it still moves bytes. An op whose formula fails adds none either, and :attr:`notes`
        names it (the replay's deadline or containment, raised by an op the formula ran, stops the replay as anywhere
        else). A query of a tensor's metadata is not counted.
        """
        if _metadata(func):
            return
        try:
            flops = _flops(func, args, kwargs, output)
        except (ReplayDeadlineError, ContainmentError):  # the replay's own stops, from an op a formula ran
            raise
        except Exception as error:  # noqa: BLE001 -- a FLOP formula (torch's or a registered one), not the user's code: noted
            self._failed.setdefault(op_name(func), f"{type(error).__name__}: {error}")
            flops = 0
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

    def get_total_flops(self) -> int:
        """FLOPs counted so far (multiply-adds count 2, as in torch's formulas)."""
        return self._total

    def work(self) -> StepWork:
        """Every op counted so far, grouped: FLOPs, bytes moved, phase, dtype, recomputed or not."""
        return grouped(self._ops)

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per op whose FLOP formula failed: its FLOPs are left out of :meth:`get_total_flops`."""
        return tuple(
            f"{op}: its FLOP formula failed ({error}); its FLOPs are left out of the step's FLOPs and step time"
            for op, error in self._failed.items()
        )


def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> int:
    """FLOPs of ``func`` run on ``args`` and ``kwargs``, giving ``output``; 0 for an op without a formula.

    Attention's by :func:`attention_flops` and :func:`attention_backward_flops`, the fused recurrent kernels' (LSTM,
    GRU, RNN) by :data:`~lightning_vram.prediction.replay.rnn_flops.RECURRENT_FORMULAS`, any other op's by torch's
    formula.
    """
    packet = getattr(func, "_overloadpacket", None)
    if packet in _ATTENTION:
        query, key, value = args[:3]
        return attention_flops(query.shape, key.shape, value.shape)
    if packet in _ATTENTION_BACKWARD:
        gradient, query, key, value = args[:4]
        return attention_backward_flops(gradient.shape, query.shape, key.shape, value.shape)
    if packet in RECURRENT_FORMULAS:
        return RECURRENT_FORMULAS[packet](*args, **kwargs)
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=output))
    return 0


def attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """FLOPs of attention's forward: the scores ``query @ key^T`` and the output ``scores @ value``.

    Shapes ``(batch, heads, length, head_dim)``; key and value may have fewer heads than the query (grouped-query
    attention), a divisor of its heads: each is broadcast to the query's heads, so the FLOPs are those of as many
    heads as the query has. Multiply-adds count 2, the mask and softmax none, a causal mask's skipped half is
    counted (torch's ``sdpa_flop_count``).

    >>> attention_flops((2, 8, 16, 4), (2, 2, 32, 4), (2, 2, 32, 6))  # 2 x 2·8·16·32 x (4 + 6)
    163840
    >>> attention_flops((2, 8, 16, 4), (2, 8, 32, 4), (2, 8, 32, 6))
    163840
    """
    batch, heads, length, head_dim = query
    return 2 * batch * heads * length * _key_length(query, key, value) * (head_dim + value[3])


def attention_backward_flops(
    gradient: Sequence[int], query: Sequence[int], key: Sequence[int], value: Sequence[int]
) -> int:
    """FLOPs of attention's backward: the scores recomputed, then the gradients of scores, value, query and key.

    Shapes as for :func:`attention_flops` (``gradient`` the output's: the query's, with the value's head_dim), key and
    value heads broadcast to the query's; torch's ``sdpa_backward_flop_count``, five products of the scores' size.

    >>> attention_backward_flops((2, 8, 16, 6), (2, 8, 16, 4), (2, 2, 32, 4), (2, 2, 32, 6))  # 2·8·16·32 x 2(3·4 + 2·6)
    393216
    """
    batch, heads, length, head_dim = query
    key_length = _key_length(query, key, value)
    if tuple(gradient) != (batch, heads, length, value[3]):
        raise ValueError(
            f"the output's gradient {tuple(gradient)} is not the query's {tuple(query)} by head_dim {value[3]}"
        )
    return 2 * batch * heads * length * key_length * (3 * head_dim + 2 * value[3])


def _key_length(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> int:
    """The keys' length, the shapes checked against each other (a ValueError where they do not match).

    >>> _key_length((1, 8, 5, 4), (1, 2, 7, 4), (1, 2, 7, 6))
    7
    >>> _key_length((1, 8, 5, 4), (1, 3, 7, 4), (1, 3, 7, 4))
    Traceback (most recent call last):
    ValueError: 3 key/value heads do not divide 8 query heads
    """
    batch, heads, _, head_dim = query
    key_batch, key_heads, key_length, key_dim = key
    value_batch, value_heads, value_length, _ = value
    if (key_batch, value_batch, key_dim, value_heads, value_length) != (batch, batch, head_dim, key_heads, key_length):
        raise ValueError(f"query {tuple(query)}, key {tuple(key)} and value {tuple(value)} do not match")
    if heads % key_heads:
        raise ValueError(f"{key_heads} key/value heads do not divide {heads} query heads")
    return int(key_length)


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
