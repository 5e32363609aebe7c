"""The FLOPs of a replayed step, counted from the ops the replay's live count already sees.

torch's ``FlopCounterMode`` is a dispatch mode of its own, and it changes the step it counts: an op without a FLOP
formula is decomposed where it can be (CPU flash attention, ``_scaled_dot_product_flash_attention_for_cpu``, becomes
its math ops, which save more for backward: a BERT-style replay's backward peak rose 4%), and its module tracker's
gradient hooks held gradients longer (a checkpointed ResNet's backward peak rose 28.6 KiB). :class:`StepFlops`
runs no mode of its own: the live count (:class:`~lightning_vram.prediction.replay.live.LiveMemory`) hands it each op
as it ran, and it adds torch's own formula for it (``torch.utils.flop_counter.flop_registry``; CPU flash attention by
torch's attention formulas), so every memory figure of the replay stays as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class StepFlops:
    """The step's total FLOPs (:meth:`get_total_flops`), from every op :meth:`count` is handed."""

    def __init__(self) -> None:
        self._total = 0

    def count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Add the FLOPs of one op that ran (``func`` on ``args`` and ``kwargs``, giving ``output``).

        Only where torch has a formula for it: an op without one (elementwise, copies) adds nothing, as in
        ``FlopCounterMode``.
        """
        packet = getattr(func, "_overloadpacket", None)
        if packet is _CPU_FLASH:
            query, key, value = args[:3]
            self._total += sdpa_flop_count(query.shape, key.shape, value.shape)  # type: ignore[no-untyped-call]
        elif packet is _CPU_FLASH_BACKWARD:
            gradient, query, key, value = args[:4]
            self._total += sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
                gradient.shape, query.shape, key.shape, value.shape
            )
        elif packet in flop_registry:
            self._total += int(flop_registry[packet](*args, **kwargs, out_val=output))

    def get_total_flops(self) -> int:
        """FLOPs counted so far (multiply-adds count 2, as in torch's formulas)."""
        return self._total
