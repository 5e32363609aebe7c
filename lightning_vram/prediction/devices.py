"""The GPUs a prediction is asked about, and what a device holds beyond the step's own memory.

The GPUs the fit table lists, the share of a device kept free when predicting the largest batch, and the CUDA
context assumed where NVML could not measure it.
"""

from __future__ import annotations

from lightning_vram.units import MIB

DRIVER_HELD_BYTES = 1024 * MIB
"""What the driver keeps from CUDA of a card's NVML total, where CUDA's own total was not recorded: at most this
(the H200 kept 0.6 GiB: 143,771 MiB in NVML, 150,109,880,320 B in CUDA; a T4 0.24 GiB, its ECC)."""
COMMON_GPUS: tuple[tuple[str, int], ...] = (
    ("RTX 3060 (12 GB)", 12_288 * MIB - DRIVER_HELD_BYTES),
    ("T4 (16 GB)", 15_843_721_216),
    ("RTX 3090 / 4090, A10, L4 (24 GB)", 23_028 * MIB - DRIVER_HELD_BYTES),
    ("A100 40GB", 40_960 * MIB - DRIVER_HELD_BYTES),
    ("A100 80GB / H100 80GB", 81_559 * MIB - DRIVER_HELD_BYTES),
    ("H200 (141 GB)", 150_109_880_320),
)
"""Cards people commonly train on or rent, each with the memory CUDA can use on it, in bytes (the most a caching
allocator can reserve there before the CUDA context): ``torch.cuda.get_device_properties(i).total_memory`` where
it was recorded (the H200 of tests/data/gpu-traces; the T4 as NVIDIA's deviceQuery prints it), else the card's
NVML total (nvidia-smi's MiB; a row of several cards takes the smallest: A10's 23,028 MiB, H100's 81,559 MiB) less
:data:`DRIVER_HELD_BYTES`. Marketing figures are larger (an H200 is sold as 141 GB, CUDA sees 139.80 GiB): a fit
table over them promised batches that did not fit."""
BATCH_SAFETY_MARGIN = 0.10
"""Share of capacity kept free when predicting the largest batch (allocator rounding, other processes)."""
DEFAULT_CUDA_CONTEXT_BYTES = 512 * MIB
"""CUDA context and library workspaces, in bytes, when NVML could not measure them (typically a few hundred MiB)."""
