"""The GPUs a prediction is asked about, and what a device holds beyond the step's own memory.

The GPUs the fit table lists, the share of a device kept free when predicting the largest batch, and the CUDA
context assumed where NVML could not measure it.
"""

from __future__ import annotations

from lightning_vram.units import GIB, MIB

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
