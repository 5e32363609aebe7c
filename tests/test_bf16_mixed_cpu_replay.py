"""bf16-mixed on the CPU: the replay reproduces the sampled step, phase by phase, and the advice is simulated.

Lightning's ``MixedPrecision`` plugin runs the training step under ``torch.autocast(..., cache_enabled=False)``: a
weight cast no op saved is freed at once, and a module called twice casts its weights twice. A replay with the
weight cache on held each cast until the step returned (a Linear's weight, read but not saved: forward too high)
and shared one cast between calls (a GAN's discriminator, called three times around ``manual_backward`` and
``optimizer.step`` inside one training step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import Classifier, loader, trainer
from sessions import train_steps
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor, VramSession
from lightning_vram.prediction.replay._fake import FakeTensorMode
from lightning_vram.prediction.replay.norm_dtypes import MixedNormDtypes
from lightning_vram.prediction.replay.precision import SPANNING_AUTOCAST_NOTE
from lightning_vram.records import LIVE_PEAK_PART

# A replayed step against the sampled one.
pytestmark = pytest.mark.replay


def _block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.GroupNorm(4, outputs), nn.SiLU())


class UNet(pl.LightningModule):
    """Two levels, GroupNorm and SiLU, one MaxPool2d used twice, a skip concatenated, a Linear head on the side."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2, self.bottom = _block(3, 8), _block(8, 16), _block(16, 16)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec = _block(16, 8)
        self.out = nn.Conv2d(8, 1, 1)
        self.gate = nn.Linear(16, 16)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottom(self.pool(e2))
        b = b * self.gate(b.mean((2, 3))).sigmoid()[..., None, None]
        d = self.dec(torch.cat([self.up(nn.functional.interpolate(b, scale_factor=2.0)), e1], dim=1))
        loss = nn.functional.binary_cross_entropy_with_logits(self.out(d).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class GAN(pl.LightningModule):
    """Manual optimization, two optimizers: the discriminator is called three times in one training step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(16, 128), nn.LeakyReLU(0.2), nn.Linear(128, 256))
        self.disc = nn.Sequential(nn.Linear(256, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 16)
        self.toggle_optimizer(opt_d)
        fake = self.gen(z).detach()
        d_loss = nn.functional.softplus(-self.disc(real)).mean() + nn.functional.softplus(self.disc(fake)).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = nn.functional.softplus(-self.disc(self.gen(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.losses += [d_loss.detach().clone(), g_loss.detach().clone()]

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return torch.optim.Adam(self.gen.parameters(), lr=2e-4), torch.optim.Adam(self.disc.parameters(), lr=2e-4)


def _unet() -> tuple[pl.LightningModule, TensorDataset]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 32, 32, generator=generator)
    return UNet(), TensorDataset(x, (torch.rand(32, 1, 32, 32, generator=generator) > 0.5).float())


def _gan() -> tuple[pl.LightningModule, TensorDataset]:
    return GAN(), TensorDataset(torch.randn(64, 256, generator=torch.Generator().manual_seed(2)))


@dataclass(frozen=True)
class Trained:
    losses: list[torch.Tensor]
    state: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]
    report: Report | None


def _fit(root: Path, build: Any, monitored: bool) -> Trained:
    torch.manual_seed(0)
    module, data = build()
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    run = trainer(root, [monitor] if monitored else [], max_steps=3, precision="bf16-mixed")
    run.fit(module, loader(data, batch_size=8))
    state = {key: value.detach().clone() for key, value in module.state_dict().items()}
    optimizers = [optimizer.state_dict() for optimizer in run.optimizers]
    return Trained(module.losses, state, optimizers, monitor.report if monitored else None)


def _same_state(first: dict[str, Any], second: dict[str, Any]) -> bool:
    for key, value in first["state"].items():
        other = second["state"][key]
        if any(not torch.equal(value[name], other[name]) for name in value):
            return False
    return True


def assert_every_phase_replayed_as_measured(report: Report) -> None:
    """Each phase's replayed live peak within the match's tolerance of the sampled step's (printed), the match held."""
    assert report.simulation is not None and report.simulation.match is not None
    match = report.simulation.match
    live = {
        part.phase: (part.measured_bytes, part.replayed_bytes) for part in match.parts if part.part == LIVE_PEAK_PART
    }
    print({phase.value: figures for phase, figures in live.items()})
    assert len(live) == 3
    for measured, replayed in live.values():
        assert abs(replayed - measured) <= match.tolerance * measured, live
    assert match.matches and report.simulation.skipped is None


@pytest.mark.parametrize("build", [_unet, _gan], ids=["unet", "gan"])
def test_bf16_mixed_on_the_cpu_replays_every_phase_as_measured(tmp_path: Path, build: Any) -> None:
    plain = _fit(tmp_path / "plain", build, monitored=False)
    monitored = _fit(tmp_path / "monitored", build, monitored=True)
    # The monitor stays invisible: bit for bit the same losses, weights and optimizer state.
    assert len(plain.losses) == len(monitored.losses)
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, monitored.losses, strict=True))
    assert [key for key in plain.state if not torch.equal(plain.state[key], monitored.state[key])] == []
    assert all(_same_state(a, b) for a, b in zip(plain.optimizers, monitored.optimizers, strict=True))

    report = monitored.report
    assert report is not None
    assert_every_phase_replayed_as_measured(report)
    assert report.simulation.variants  # the advice is simulated, not modelled
    assert all(variant.replayed is not None for variant in report.simulation.variants)


def _norm_outputs(x: torch.Tensor, weight: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Each output's dtype and shape: GroupNorm's forward and backward, LayerNorm's and BatchNorm's forward."""
    aten = torch.ops.aten
    group = aten.native_group_norm(x, weight, weight, 4, 8, 16, 2, 1e-5)
    backward = aten.native_group_norm_backward(x, x, group[1], group[2], weight, 4, 8, 16, 2, [True, True, True])
    layer = aten.native_layer_norm(x, [4], weight[:4], weight[:4], 1e-5)
    batch = aten.native_batch_norm(x, weight, weight, torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)
    return [(tensor.dtype, tuple(tensor.shape)) for tensor in (*group, *backward, *layer, *batch)]


def test_mixed_type_norms_replay_with_the_real_kernels_dtypes() -> None:
    real = _norm_outputs(torch.randn(4, 8, 4, 4, dtype=torch.bfloat16), torch.randn(8))
    # The real kernels: float32 statistics (outputs 1, 2, 7, 8, 10, 11), GroupNorm's input gradient in bfloat16 (3).
    assert [real[index][0] for index in (1, 2, 7, 8, 10, 11)] == [torch.float32] * 6
    assert real[3] == (torch.bfloat16, (4, 8, 4, 4))
    with FakeTensorMode():
        fake = _norm_outputs(torch.empty(4, 8, 4, 4, dtype=torch.bfloat16), torch.empty(8))
    with FakeTensorMode(), MixedNormDtypes():
        replayed = _norm_outputs(torch.empty(4, 8, 4, 4, dtype=torch.bfloat16), torch.empty(8))
    assert fake[1][0] == fake[7][0] == torch.bfloat16 and fake[3][0] == torch.float32  # torch's fake kernels
    assert replayed == real


class TwiceLinear(nn.Module):
    """One Linear called twice: under autocast's weight cache its bf16 weight is cast once and held through the step."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256)
        self.head = nn.Linear(256, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.linear(torch.relu(self.linear(inputs)))))  # type: ignore[no-any-return]


def test_a_plain_loop_s_own_autocast_caches_its_weights_and_the_replay_does_too(tmp_path: Path) -> None:
    """A plain loop's ``torch.autocast`` keeps torch's default cache on, unlike the Trainer's plugin: a replay with the
    cache off cast the Linear's weight twice and freed each cast at once, where the step held one (backward replayed
    1,075,880 B for 814,764 measured). The loop's autocast is around the forward pass, as torch advises."""
    torch.manual_seed(0)
    module = Classifier(TwiceLinear())
    optimizer = module.configure_optimizers()
    data = loader(TensorDataset(torch.randn(64, 256), torch.randint(0, 4, (64,))), batch_size=16)
    session = VramSession(log_dir=tmp_path, attribution_start_step=1, attribution_every_n_steps=None)
    session.start(module, optimizers=[optimizer], dataloader=data, precision="bf16-mixed")
    for step, batch in zip(range(3), data, strict=False):
        session.batch_start(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the user's own, cache on
            loss = module.training_step(batch, step)
        kept = loss.detach().clone()  # noqa: F841 -- alive through the step, as Lightning's ClosureResult.loss
        optimizer.zero_grad()
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        session.batch_end()
    session.finish()
    assert session.report is not None
    assert_every_phase_replayed_as_measured(session.report)


def test_an_autocast_spanning_the_session_s_calls_keeps_its_cache_from_the_replay(tmp_path: Path) -> None:
    """The user's autocast spans the whole loop, and so the replay: the replay runs outside it with the cache off, and
    says so. It had run inside it and left its fake casts in autocast's cache ("24 fake tensor(s) of the replay are
    still held outside it"), then emptied that cache, which the loop's stale casts live in (another model trained:
    tests/hostile/test_autocast_spanning_the_loop.py)."""
    torch.manual_seed(0)
    module = Classifier(TwiceLinear())
    optimizer = module.configure_optimizers()
    data = loader(TensorDataset(torch.randn(64, 256), torch.randint(0, 4, (64,))), batch_size=16)
    session = VramSession(log_dir=tmp_path, attribution_start_step=1, attribution_every_n_steps=None)
    session.start(module, optimizers=[optimizer], dataloader=data, precision="bf16-mixed")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # forward and backward both inside, cache on
        train_steps(session, module, optimizer, data, 3)
    session.finish()
    report = session.report
    assert report is not None and report.simulation is not None and report.simulation.baseline is not None
    assert SPANNING_AUTOCAST_NOTE in report.simulation.baseline.notes
    assert "held outside" not in (report.simulation.skipped or "")
