"""allocator-fragmentation, simulated: what expandable segments return on the run's own replayed step.

The replay runs on the CPU with the allocator's settings passed explicitly, so its allocation sequence goes through
the caching allocator's model; the summary says the run was on CUDA.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from advice_summaries import healthy_setup, healthy_summary, peak
from lightning import LightningModule
from torch import nn

from lightning_vram.advice.rules.allocator_fragmentation import (
    MATERIAL_BYTES,
    allocator_fragmentation,
    simulated_reserve,
)
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import Phase, SavingBasis, Simulation
from lightning_vram.units import GIB, MIB, format_bytes

pytestmark = pytest.mark.replay  # the saving is simulated on the replay

ROWS, COLUMNS, GROWTH = 1024, 3 * 1024, 512
"""The batch: 1024 x 3072 float32 = 12 MiB; a growing step adds 512 columns (2 MiB) eight times."""


class Working(LightningModule):
    """A step that rebuilds a 12 MiB tensor eight times, freeing the last each time: growing, or the same size."""

    def __init__(self, grow: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.grow = grow

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        hidden = batch
        with torch.no_grad():
            for _ in range(8):  # each new tensor is allocated before the last one is freed
                hidden = torch.cat([hidden, hidden[:, :GROWTH]], dim=1) if self.grow else hidden + 1.0
        return (hidden[:, :1] * self.scale).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _simulated(grow: bool, settings: AllocatorSettings) -> Simulation:
    batch = torch.zeros(ROWS, COLUMNS)
    return Predictor(Working(grow), None, batch, warm_up=True, allocator=settings).simulate()


FRAGMENTED_RUN = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, reserved=11 * GIB))
"""A run whose measured reserve is far above its allocated peak: the old rule advised on that alone."""


def test_a_step_whose_growing_tensors_leave_holes_is_advised_the_simulated_saving() -> None:
    simulation = _simulated(True, AllocatorSettings())
    reserve = simulated_reserve(simulation)
    assert reserve is not None
    # torch's defaults: the batch's 12 MiB segment, then one new segment per size (14, 16, ... 28 MiB: no freed one
    # fits the next), the freed ones kept; and the small pool's 2 MiB. Expandable segments map 20 MiB pages as
    # needed and reuse the freed ones: the batch and the two largest (12 + 26 + 28 MiB) in four pages.
    default, expandable = reserve
    assert default == 12 * MIB + sum(12 * MIB + 2 * MIB * grown for grown in range(1, 9)) + 2 * MIB
    assert expandable == 4 * 20 * MIB + 2 * MIB
    assert default - expandable > MATERIAL_BYTES
    advice = allocator_fragmentation(healthy_summary(), healthy_setup(), simulation)
    assert advice is not None
    assert advice.saving_basis is SavingBasis.SIMULATED
    assert advice.estimated_saving_bytes == default - expandable
    assert f"reserves {format_bytes(default)} with the run's settings (torch defaults)" in advice.evidence
    assert f"and {format_bytes(expandable)} with expandable_segments:True" in advice.evidence
    assert "measured: reserved 8.50 GiB at the peak while 8.00 GiB were allocated" in advice.evidence


def test_a_step_that_reuses_its_blocks_is_not_advised_whatever_the_measured_reserve() -> None:
    simulation = _simulated(False, AllocatorSettings())
    reserve = simulated_reserve(simulation)
    assert reserve is not None
    default, expandable = reserve
    assert default - expandable < MATERIAL_BYTES  # the same 12 MiB block is freed and taken again
    # The old rule's false alarms: a reserve far above the allocated peak, or retries, with nothing to gain.
    assert allocator_fragmentation(FRAGMENTED_RUN, healthy_setup(), simulation) is None
    assert allocator_fragmentation(replace(FRAGMENTED_RUN, alloc_retries=3), healthy_setup(), simulation) is None
    # Without a simulation the measured signs still advise, modelled.
    modelled = allocator_fragmentation(FRAGMENTED_RUN, healthy_setup(), None)
    assert modelled is not None and modelled.saving_basis is SavingBasis.MODELLED


def test_a_run_that_already_has_expandable_segments_is_not_advised() -> None:
    simulation = _simulated(True, AllocatorSettings(expandable_segments=True))
    assert simulation.allocator_conf == "expandable_segments:True"
    assert simulation.expandable_reserved_bytes is None and simulated_reserve(simulation) is None
    assert allocator_fragmentation(FRAGMENTED_RUN, healthy_setup(), simulation) is None
