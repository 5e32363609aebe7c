"""Real training set-ups beyond the default loop: resume, gradient accumulation, precision."""

from __future__ import annotations

from pathlib import Path

import torch
from models import FLOAT32, OPTIMIZERS, PARAMETER_COUNTS, Classifier, cnn_net, dataset_for, linear_net, loader, trainer
from test_cuda_path import scripted_steps

from lightning_vram import VramMonitor
from lightning_vram.records import Phase
from lightning_vram.testing import ScriptedProbe

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
    assert saved["callbacks"]["VramMonitor"]["tracker"]["steps"] == 4

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
