"""What the CUDA caching allocator reserves for a storage, which a replay under fake tensors must work out itself.

Storage identity and counting, for fake tensors as for real ones, are the monitor's
(:mod:`lightning_vram.measure.storages`).
"""

from __future__ import annotations

ALLOCATOR_BLOCK_BYTES = 512
"""The CUDA caching allocator hands out blocks in multiples of 512 bytes (its ``kMinBlockSize``)."""


def allocator_bytes(nbytes: int) -> int:
    """The bytes the CUDA caching allocator reserves for a tensor of ``nbytes``: whole 512-byte blocks.

    >>> allocator_bytes(0), allocator_bytes(1), allocator_bytes(512), allocator_bytes(513)
    (0, 512, 512, 1024)
    """
    return -(-nbytes // ALLOCATOR_BLOCK_BYTES) * ALLOCATOR_BLOCK_BYTES
