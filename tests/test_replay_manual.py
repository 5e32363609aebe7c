"""Manual optimization replayed (issue 26, item 3): the user's ``training_step`` calling ``self.optimizers()``,
``self.manual_backward``, ``opt.zero_grad()``, ``opt.step()`` and ``self.toggle_optimizer`` on the replay's own.

0.11.0 skipped the replay of any module with ``automatic_optimization = False`` ("the replay reproduces Lightning's
automatic optimization only"): its advice stayed modelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import trainer
from test_setups import Gan, gan_data
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.records import LIVE_PEAK_PART, Phase, SavingBasis

pytestmark = pytest.mark.replay

FLOAT32 = 4
PARAMETER_BYTES = ((8 * 32 + 32) + (32 * 16 + 16) + (16 * 64 + 64) + (64 + 1)) * FLOAT32


class ToggledGan(Gan):
    """The GAN of Lightning's docs: each network's step inside ``toggled_optimizer``, a single-optimizer call too."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()  # type: ignore[misc]
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        with self.toggled_optimizer(generator_optimizer):
            fake = self.generator(torch.randn(real.shape[0], 8))
            generator_loss = bce(self.discriminator(fake), ones)
            self.manual_backward(generator_loss)
            generator_optimizer.step()
            generator_optimizer.zero_grad()
        self.toggle_optimizer(discriminator_optimizer)
        discriminator_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        self.manual_backward(discriminator_loss)
        discriminator_optimizer.step()
        discriminator_optimizer.zero_grad()
        self.untoggle_optimizer(discriminator_optimizer)


@pytest.mark.parametrize("module", [Gan, ToggledGan])
def test_a_gan_with_two_optimizers_replays_its_sampled_step_and_its_advice_is_simulated(
    tmp_path: Path, module: type[Gan]
) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=8).fit(module(), gan_data())
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None
    match, baseline = simulation.match, simulation.baseline
    assert match is not None and match.matches and match.step == 2 and baseline is not None
    for part in match.parts:
        print(f"{module.__name__} {part.phase.value:9} {part.part:16} {part.measured_bytes:6} {part.replayed_bytes:6}")
        assert part.relative_error <= match.tolerance
    assert {part.phase for part in match.parts} == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    assert {part.part for part in match.parts if part.part == LIVE_PEAK_PART} == {LIVE_PEAK_PART}
    optimizer = baseline.phases[Phase.OPTIMIZER].breakdown
    assert optimizer is not None
    assert optimizer.parameters == PARAMETER_BYTES
    assert optimizer.optimizer_state == 2 * PARAMETER_BYTES + 8 * FLOAT32  # both Adams stepped in the replay
    assert simulation.variants and all(variant.replayed is not None for variant in simulation.variants)
    report = monitor.report
    assert report is not None
    modelled = [advice.id.value for advice in report.advice if advice.saving_basis is SavingBasis.MODELLED]
    assert modelled in ([], ["optimizer-state"])  # the one rule that declares no change to replay
    # The tiny GAN's changes save too little to advise: each rule answers with its replayed figure.
    answered = {row.id.value: row.reason for row in report.not_advised}
    for rule in ("mixed-precision", "activation-checkpointing", "inplace-activations"):
        assert answered[rule].startswith("replayed, ")
