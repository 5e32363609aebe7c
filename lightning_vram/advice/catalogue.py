"""Facts about devices, precisions and strategies that the rules and the replays share.

The GPUs the fit table lists, the share of a device kept free when predicting the largest batch, the CUDA context
assumed where NVML could not measure it, and which 16-bit precision a device should train in.
"""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2

COMMON_GPUS: tuple[tuple[str, int], ...] = (
    ("RTX 3060 (12 GiB)", 12 * GIB),
    ("T4 (16 GiB)", 16 * GIB),
    ("RTX 3090 / 4090, A10, L4 (24 GiB)", 24 * GIB),
    ("A100 40GB", 40 * GIB),
    ("A100 80GB / H100 80GB", 80 * GIB),
    ("H200 (141 GiB)", 141 * GIB),
)
"""Nominal capacities in bytes of cards people commonly train on or rent; the safety margin covers what they lack."""
BATCH_SAFETY_MARGIN = 0.10
"""Share of capacity kept free when predicting the largest batch (allocator rounding, other processes)."""
DEFAULT_CUDA_CONTEXT_BYTES = 512 * MIB
"""CUDA context and library workspaces, in bytes, when NVML could not measure them (typically a few hundred MiB)."""

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
