"""Storages freed by ``resize_(0)`` while autograd holds them, as FSDP1 frees its gathered flat parameters.

A storage's data can be freed while the storage lives (``untyped_storage().resize_(0)``): the next allocation of its
size is then placed at its address. The count knows storages by identity, so that allocation is never taken for
the freed one.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.records import Phase

ELEMENTS = 9 * 2**20
"""Elements of each tensor saved (float32: 36 MiB, past glibc's largest threshold for serving an allocation by
``mmap``, 32 MiB on 64-bit Linux): freed, its pages are unmapped, and the next mapping of its size is placed in the
hole it left, as the kernel places mappings from the top down."""
TRIES = 8
"""Tensors allocated at most until one lands at the freed address."""


class FreesWhatItSaved(nn.Module):
    """Saves a tensor, frees its data by ``resize_(0)``, and saves another allocated at the freed address."""

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[tuple[int, int]] = []
        """(freed tensor's address, the saved next one's) per call."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        gathered = torch.ones(ELEMENTS)  # a unit's gathered parameters
        hidden = inputs * gathered  # saves ``gathered`` (``inputs`` requires the gradient, ``gathered`` not)
        address = gathered.untyped_storage().data_ptr()
        gathered.untyped_storage().resize_(0)  # freed after use, as FSDP1 frees it after the unit's forward
        placed = [torch.ones(ELEMENTS)]  # the next unit's, at the freed address (kept alive till it lands there)
        while placed[-1].data_ptr() != address and len(placed) < TRIES:
            placed.append(torch.ones(ELEMENTS))
        self.addresses.append((address, placed[-1].data_ptr()))
        return hidden * placed[-1]  # saves it


def test_a_storage_allocated_at_a_freed_saved_storages_address_counts_apart() -> None:
    # Both storages held 36 MiB when autograd saved them: each counts once. Keyed by data pointer, the second was
    # taken for the first (36 MiB counted).
    module = FreesWhatItSaved()
    inputs = torch.randn(ELEMENTS, requires_grad=True)
    attributor = StepAttributor(0, module, [], torch.device("cpu"))
    attributor.begin_forward(inputs)
    output = module(inputs)
    attributor.before_backward()
    attribution = attributor.finish()
    [(freed, allocated)] = module.addresses
    assert freed == allocated, "the allocator placed the second tensor elsewhere: the case is not made"
    forward = attribution.phases[Phase.FORWARD]
    assert forward.activations == 2 * 4 * ELEMENTS
    assert output.shape == (ELEMENTS,)
