"""Facts about precisions and strategies that the rules share: which 16-bit precision a device should train in.

The GPUs a prediction is asked about live with prediction, in :mod:`lightning_vram.prediction.devices`.
"""

from __future__ import annotations

TENSOR_CORE_CAPABILITY = (7, 0)
"""CUDA compute capability from which GPUs have tensor cores (Volta); mixed precision is advised for speed there."""
BFLOAT16_CAPABILITY = (8, 0)
"""CUDA compute capability from which GPUs run bfloat16 fast (Ampere); before it, 16-bit means float16."""
FULL_PRECISIONS = frozenset({"32-true", "32", "64-true", "64"})
"""Lightning's precision settings that train in 32 or 64 bits: the ones mixed precision can improve."""
SHARDING_STRATEGIES = frozenset({"FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"})
"""Lightning strategies whose optimizer state is already sharded: the counts are this rank's shard."""


def mixed_precision_for(device_type: str, capability: tuple[int, int] | None) -> str:
    """The 16-bit mixed precision to try on a device: bfloat16 where it is fast (and off CUDA), else float16.

    >>> mixed_precision_for("cuda", (8, 6)), mixed_precision_for("cuda", (7, 5)), mixed_precision_for("cpu", None)
    ('bf16-mixed', '16-mixed', 'bf16-mixed')
    """
    fast_bfloat16 = device_type != "cuda" or (capability is not None and capability >= BFLOAT16_CAPABILITY)
    return "bf16-mixed" if fast_bfloat16 else "16-mixed"
