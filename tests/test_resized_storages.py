"""Storages freed by ``resize_(0)`` while autograd holds them, as FSDP1 frees its gathered flat parameters.

A storage's data can be freed while the storage lives (``untyped_storage().resize_(0)``): the next allocation of its
size is then placed at its address. The count knows storages by identity, so that allocation is never taken for
the freed one; and FSDP1's gathered flat parameters, which autograd saves views of, are not activations.
"""

from __future__ import annotations

import pytest
import torch
from models import saved_storage_bytes
from torch import nn
from zero_fsdp1_ranks import BATCH_SHAPE, train, transformer

from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.prediction.strategies.fsdp2 import fake_group
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


def saved_bytes(module: nn.Module, batch: torch.Tensor) -> int:
    """Bytes autograd saves in ``module``'s step (the output's mean square), counted directly: unique storages,
    parameters left out."""
    return saved_storage_bytes(lambda: module(batch).square().mean(), exclude=list(module.parameters()))


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1s_gathered_flat_parameters_are_not_activations(sharding: str) -> None:
    # tests/zero_fsdp1_ranks.py's transformer, each encoder layer a unit, rank 0 of 2 under the fake process group
    # (FSDP1 gathers into and frees its storages as on gloo; the gathered values are not read), two runs: the step's
    # activations are what the unwrapped module saves (350,720 bytes), the same each run. Counted by data pointer
    # they were 621,096 then 487,208 bytes in the two runs (FULL_SHARD); by identity with each unit's gathered flat
    # parameter at its gathered size, 621,096 (every unit's 67,594 elements, 270,376 bytes, more).
    torch.manual_seed(0)
    expected = saved_bytes(transformer(), torch.randn(*BATCH_SHAPE))
    assert expected == 350_720
    with fake_group(2):
        runs = [train(f"fsdp {sharding}", 0, 1) for _ in range(2)]
    counted = [(phases["forward"]["activations"], phases["backward"]["activations"]) for phases in runs]
    assert counted == [(expected, expected)] * 2
