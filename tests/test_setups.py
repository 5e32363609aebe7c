"""Real training set-ups beyond the default loop: resume, gradient accumulation, precision."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from models import FLOAT32, OPTIMIZERS, PARAMETER_COUNTS, Classifier, cnn_net, dataset_for, linear_net, loader, trainer
from scripted import scripted_steps
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.records import Phase
from lightning_vram.render.text import summary_text
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe
from lightning_vram.units import format_bytes

MIB = 1024**2


def test_resume_from_a_checkpoint_covers_the_whole_run(tmp_path: Path) -> None:
    # First run: 4 steps, its highest peak in step 1's forward (900 MiB).
    first_steps = [(300 * MIB, 350 * MIB, 200 * MIB)] * 4
    first_steps[1] = (900 * MIB, 350 * MIB, 200 * MIB)
    first = VramMonitor(
        probe=ScriptedProbe(scripted_steps(first_steps)), attribution_start_step=100, console_summary=False
    )
    module = Classifier(linear_net(), OPTIMIZERS["adam"])
    fit = trainer(tmp_path / "first", [first], max_steps=4)
    fit.fit(module, loader(dataset_for("linear", samples=32)))  # one epoch of 4 steps: checkpoint at its end
    checkpoint = tmp_path / "run.ckpt"
    fit.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)  # plain data only: loads under the safe unpickler
    assert saved["callbacks"][first.state_key]["tracker"]["steps"] == 4

    # Resumed run: 4 more steps, none above 400 MiB.
    second = VramMonitor(
        probe=ScriptedProbe(scripted_steps([(310 * MIB, 400 * MIB, 200 * MIB)] * 4)),
        attribution_start_step=100,
        console_summary=False,
    )
    trainer(tmp_path / "second", [second], max_steps=8).fit(
        Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)), ckpt_path=checkpoint
    )
    report = second.report
    assert report is not None
    assert report.steps == 8
    assert report.peak is not None and (report.peak.step, report.peak.peak_bytes) == (1, 900 * MIB)
    assert report.phases[Phase.BACKWARD].peak_bytes == 400 * MIB and report.phases[Phase.BACKWARD].step >= 4
    assert [point.step for point in report.recent_peaks] == list(range(8))


def test_gradient_accumulation_has_an_optimizer_phase_only_when_stepping(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=0, attribution_every_n_steps=1, console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=3, accumulate_grad_batches=2)
    fit.fit(Classifier(linear_net(), OPTIMIZERS["sgd_momentum"]), loader(dataset_for("linear")))
    report = monitor.report
    assert report is not None and report.steps == 6  # micro-batches
    optimizer = report.phases[Phase.OPTIMIZER]
    assert optimizer.step % 2 == 1  # only the second micro-batch of each window steps
    parameter_bytes = PARAMETER_COUNTS["linear"] * FLOAT32
    assert optimizer.breakdown is not None
    assert (optimizer.breakdown.gradients, optimizer.breakdown.optimizer_state) == (parameter_bytes, parameter_bytes)


def test_bytes_are_counted_in_each_tensors_real_dtype(tmp_path: Path) -> None:
    reports = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
        trainer(tmp_path / precision, [monitor], max_steps=2, precision=precision).fit(
            Classifier(cnn_net()), loader(dataset_for("cnn"), batch_size=16)
        )
        assert monitor.report is not None and monitor.report.precision == precision
        reports[precision] = monitor.report.phases[Phase.FORWARD].breakdown
    full, mixed, half = reports["32-true"], reports["bf16-mixed"], reports["bf16-true"]
    assert full is not None and mixed is not None and half is not None
    parameters = PARAMETER_COUNTS["cnn"]
    assert (full.parameters, mixed.parameters, half.parameters) == (parameters * 4, parameters * 4, parameters * 2)
    assert half.gradients == parameters * 2
    # Autocast runs the convolution and the linear layer in bfloat16: their saved tensors shrink, BatchNorm's do not.
    assert half.activations < mixed.activations < full.activations


class Gan(pl.LightningModule):
    """A tiny GAN with manual optimization: discriminator step, then generator step, in every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()  # type: ignore[misc]
        fake = self.generator(torch.randn(real.shape[0], 8))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        discriminator_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        discriminator_optimizer.zero_grad()
        self.manual_backward(discriminator_loss)
        discriminator_optimizer.step()
        generator_loss = bce(self.discriminator(fake), ones)
        generator_optimizer.zero_grad()
        self.manual_backward(generator_loss)
        generator_optimizer.step()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.discriminator.parameters())


def gan_data(batch_size: int = 8) -> Any:
    return loader(TensorDataset(torch.randn(64, 16)), batch_size)


def test_manual_optimization_with_two_optimizers_counts_both_networks(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=8).fit(Gan(), gan_data())  # max_steps counts both optimizers' steps
    report = monitor.report
    assert report is not None and report.steps == 4
    parameter_bytes = ((8 * 32 + 32) + (32 * 16 + 16) + (16 * 64 + 64) + (64 + 1)) * FLOAT32
    optimizer = report.phases[Phase.OPTIMIZER].breakdown
    assert optimizer is not None
    assert optimizer.parameters == parameter_bytes
    assert optimizer.optimizer_state == 2 * parameter_bytes + 8 * FLOAT32  # two Adams, 8 parameter tensors
    saved = {row.name: row.activation_bytes for row in report.modules}
    # The discriminator's first layer saves its input three times a step: real, fake (discriminator loss), and
    # fake again in the generator's pass, after the discriminator's backward released it. The hooks see all.
    assert saved["discriminator.0"] == 3 * 8 * 16 * FLOAT32
    assert saved["generator.0"] == 8 * 8 * FLOAT32
    forward = report.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.activations > 0


def test_manual_optimization_phases_follow_backward_and_optimizer_calls(tmp_path: Path) -> None:
    # Ten boundaries a step: start, then for the discriminator and the generator each: before backward, after it
    # (on_after_backward), before the step, after the update (torch's step post-hook); then the step's end.
    highs = [100, 300, 500, 120, 700, 350, 400, 110, 600, 200]
    boundaries = [ScriptedBoundary(100 * MIB, 600 * MIB, high * MIB) for high in highs] * 4
    probe = ScriptedProbe(boundaries)
    monitor = VramMonitor(probe=probe, attribution_start_step=100, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=8).fit(Gan(), gan_data())
    report = monitor.report
    assert report is not None and probe.reads == 10 * 4
    # The discriminator's update (700 MiB) is the optimizer phase's, not the generator's forward pass after it (350
    # MiB, which beats the first forward's 300); the code after a backward (120, 110) counts with it (500 kept).
    assert report.phases[Phase.FORWARD].peak_bytes == 350 * MIB
    assert report.phases[Phase.BACKWARD].peak_bytes == 500 * MIB
    assert report.phases[Phase.OPTIMIZER].peak_bytes == 700 * MIB
    assert report.peak is not None and report.peak.phase is Phase.OPTIMIZER


class WithEvaluation(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)


def evaluation_boundaries(highs: list[int]) -> list[ScriptedBoundary]:
    """Two reads per evaluation batch (start, end); the end read carries the batch's highest allocation."""
    boundaries = []
    for high in highs:
        boundaries += [
            ScriptedBoundary(100 * MIB, 2048 * MIB, 100 * MIB),
            ScriptedBoundary(100 * MIB, 2048 * MIB, high),
        ]
    return boundaries


def test_validation_peaks_are_reported_apart_from_training(tmp_path: Path) -> None:
    # Reads in order: steps 0-1 (8), validation (2 batches: 4), steps 2-3 (8), validation (4).
    training = scripted_steps([(300 * MIB, 350 * MIB, 200 * MIB)] * 2)
    boundaries = (
        training
        + evaluation_boundaries([700 * MIB, 600 * MIB])
        + training
        + evaluation_boundaries([500 * MIB, 1200 * MIB])
    )
    monitor = VramMonitor(probe=ScriptedProbe(boundaries), attribution_start_step=100, console_summary=False)
    data = loader(dataset_for("linear"))
    trainer(tmp_path, [monitor], max_steps=4, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0).fit(
        WithEvaluation(linear_net()), data, data
    )
    report = monitor.report
    assert report is not None
    assert report.peak is not None and report.peak.peak_bytes == 350 * MIB  # training alone
    assert report.to_dict()["evaluation"] == {
        "validation": {"peak_bytes": 1200 * MIB, "reserved_bytes": 2048 * MIB, "after_step": 4}
    }
    assert f"evaluation peaks: validation {format_bytes(1200 * MIB)} (after step 4)" in summary_text(report)


def test_a_standalone_test_run_reports_its_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    probe = ScriptedProbe(evaluation_boundaries([300 * MIB, 900 * MIB, 400 * MIB]))
    monitor = VramMonitor(probe=probe)
    logger = CSVLogger(tmp_path, name="csv")
    trainer(tmp_path, [monitor], logger=logger).test(WithEvaluation(linear_net()), loader(dataset_for("linear", 24)))
    assert monitor.evaluation_peaks["test"].peak_bytes == 900 * MIB
    assert probe.reads == 6 and probe.closed
    assert "VRAM: test 900.0 MiB" in capsys.readouterr().out
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").read_text().splitlines()))
    assert [float(row["vram/evaluation/test_peak_bytes"]) for row in rows] == [900 * MIB]
    assert not (tmp_path / "vram_report.json").exists()  # a fit's report in the same dir stays the fit's


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_module_is_counted_as_a_whole(tmp_path: Path, backend: str) -> None:
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=1, console_summary=False)
    module = Classifier(torch.compile(cnn_net(), backend=backend))
    trainer(tmp_path, [monitor], max_steps=4).fit(module, loader(dataset_for("cnn"), batch_size=16))
    report = monitor.report
    assert report is not None and report.steps == 4
    forward = report.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.parameters == PARAMETER_COUNTS["cnn"] * FLOAT32
    saved = {row.name: row.activation_bytes for row in report.modules}
    # The compiled graph's saved tensors are seen, charged to the compiled module; its layers get no rows.
    assert saved["network"] > 0 and not any(name.startswith("network._orig_mod") for name in saved)
    assert forward.activations == saved["network"] + saved["(training_step)"]
    note = next(item for item in report.not_measured if item.what.startswith("per-module activations inside"))
    assert "network run(s) as torch.compile graphs" in note.reason
