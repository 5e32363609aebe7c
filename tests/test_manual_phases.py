"""A manual-optimization step's phases as they ran: each optimizer's update in the optimizer phase, not in forward.

Under ``automatic_optimization = False`` a GAN runs forward, ``manual_backward``, ``opt.step()`` once per network in
one ``training_step``. Lightning calls ``on_before_backward`` and ``on_after_backward`` from ``manual_backward`` and
``on_before_optimizer_step`` from ``LightningOptimizer.step``, but no hook after an update: the monitor used to count
the first network's update with the forward pass after it (the report showed the generator's Adam update as the
forward peak, and three phase peaks within a rounding of each other). Torch's step post-hook now ends each update.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from models import trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.records import Phase

FLOAT32 = 4
# Generator: Linear(16, 512) + ConvTranspose2d(8, 3, 4); discriminator: Conv2d(3, 4, 4) + Linear(256, 1).
GENERATOR_BYTES = ((16 * 512 + 512) + (8 * 3 * 4 * 4 + 3)) * FLOAT32
DISCRIMINATOR_BYTES = ((3 * 4 * 4 * 4 + 4) + (4 * 8 * 8 + 1)) * FLOAT32
ADAM_STEP_BYTES = 8 * FLOAT32  # one `step` tensor per parameter tensor, four per network


class ConvGan(pl.LightningModule):
    """A small DCGAN: the generator's step, then the discriminator's, each in ``toggled_optimizer`` (as in Lightning's
    docs)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(
            nn.Linear(16, 8 * 8 * 8), nn.Unflatten(1, (8, 8, 8)), nn.ConvTranspose2d(8, 3, 4, 2, 1), nn.Tanh()
        )
        self.discriminator = nn.Sequential(
            nn.Conv2d(3, 4, 4, 2, 1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(4 * 8 * 8, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()  # type: ignore[misc]
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        with self.toggled_optimizer(generator_optimizer):
            fake = self.generator(torch.randn(real.shape[0], 16))
            self.manual_backward(bce(self.discriminator(fake), ones))
            generator_optimizer.step()
            generator_optimizer.zero_grad()
        with self.toggled_optimizer(discriminator_optimizer):
            loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
            self.manual_backward(loss / 2)
            discriminator_optimizer.step()
            discriminator_optimizer.zero_grad()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())


def images(batch_size: int = 8) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))), batch_size)


def test_each_update_of_a_two_optimizer_gan_is_in_the_optimizer_phase(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ConvGan()
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=8).fit(module, images())
    report = monitor.report
    assert report is not None and report.steps == 4
    forward, backward, optimizer = (report.phases[phase] for phase in Phase)
    for phase in (forward, backward, optimizer):
        print(f"{phase.phase.value:9} {phase.peak_bytes:8} {phase.breakdown}")
    counted = optimizer.breakdown
    assert counted is not None
    # The generator's update (its gradients alive while Adam steps) is the optimizer phase's highest count; before,
    # only the discriminator's, the last update, was (its gradients: DISCRIMINATOR_BYTES).
    assert counted.gradients == GENERATOR_BYTES
    assert counted.optimizer_state == 2 * (GENERATOR_BYTES + DISCRIMINATOR_BYTES) + ADAM_STEP_BYTES
    # The CPU's live peak of the generator's update was the forward phase's, the highest of the run.
    assert optimizer.peak_bytes > forward.peak_bytes
    assert report.peak is not None and report.peak.phase is Phase.OPTIMIZER
    assert len({forward.peak_bytes, backward.peak_bytes, optimizer.peak_bytes}) == 3
    # The monitor's step post-hooks leave with the run.
    assert all(not optimizer._optimizer_step_post_hooks for optimizer in module.trainer.optimizers)
