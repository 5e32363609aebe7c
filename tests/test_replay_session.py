"""The replay inside a run: once at the first sampled step, skipped with the reason where it cannot reproduce the
step, never changing the training; and the preflight check before the first step."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import OPTIMIZERS, TEST_REPLAY_BUDGET_SECONDS, Classifier, cnn_net, dataset_for, linear_net, loader, trainer
from torch import nn

from lightning_vram import VramMonitor, VramMonitorWarning, VramSession
from lightning_vram.records import CheckpointChange, FreeGradientsChange, Phase, PrecisionChange
from lightning_vram.render.text import summary_text
from lightning_vram.testing import SCRIPTED_DEVICE, ScriptedBoundary, ScriptedProbe
from lightning_vram.units import format_bytes

# The replay inside a run, and preflight.
pytestmark = pytest.mark.replay

MIB = 1024**2


def fit(tmp_path: Path, module: Classifier, steps: int = 4, **options: Any) -> VramMonitor:
    monitor = VramMonitor(attribution_start_step=1, console_summary=False, **options)
    trainer(tmp_path, [monitor], max_steps=steps).fit(module, loader(dataset_for("cnn"), batch_size=16))
    return monitor


def deep_cnn() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def test_the_first_sampled_step_is_replayed_and_matches_its_counts(tmp_path: Path) -> None:
    monitor = fit(tmp_path, Classifier(deep_cnn(), OPTIMIZERS["adam"]))
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None
    assert simulation.match is not None and simulation.match.matches and simulation.match.step == 1
    assert {part.part for part in simulation.match.parts} >= {"parameters", "gradients", "activations"}
    kinds = {type(variant.change) for variant in simulation.variants}
    assert PrecisionChange in kinds and CheckpointChange in kinds and FreeGradientsChange in kinds
    precision = next(variant for variant in simulation.variants if isinstance(variant.change, PrecisionChange))
    assert precision.change == PrecisionChange("bf16-mixed") and precision.replayed is not None
    assert monitor.report is not None and monitor.report.simulation == simulation


def test_replays_leave_the_training_exactly_as_without_them(tmp_path: Path) -> None:
    finals = []
    for budget in (0.0, TEST_REPLAY_BUDGET_SECONDS):
        torch.manual_seed(0)
        module = Classifier(deep_cnn(), OPTIMIZERS["adam"])
        monitor = fit(tmp_path / str(budget), module, replay_budget_seconds=budget)
        assert (monitor.session.simulation is None) == (budget == 0.0)
        finals.append({name: tensor.clone() for name, tensor in module.state_dict().items()})
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][name], finals[1][name]) for name in finals[0])


class ReadsAValue(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e9:  # a Python condition on a tensor's value
            raise RuntimeError("diverged")
        return loss


class Manual(Classifier):
    def __init__(self) -> None:
        super().__init__(cnn_net())
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_a_manual_step_with_one_optimizer_is_replayed_and_matches_its_counts(tmp_path: Path) -> None:
    monitor = fit(tmp_path, Manual())  # self.optimizers() returns the one optimizer, not a list
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None
    assert simulation.match is not None and simulation.match.matches and simulation.match.step == 1
    assert simulation.baseline is not None
    forward = simulation.baseline.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.gradients == 0  # the step's own zero_grad after its step freed them


@pytest.mark.parametrize(("module", "reason"), [(ReadsAValue(cnn_net()), "reads a tensor's value")], ids=["item"])
def test_a_step_the_replay_cannot_reproduce_is_skipped_with_the_reason(
    tmp_path: Path, module: Classifier, reason: str
) -> None:
    monitor = fit(tmp_path, module)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None and reason in simulation.skipped
    assert simulation.variants == ()
    assert monitor.report is not None and monitor.report.steps == 4
    # The console says why the advice is modelled, not only the report's files (a new user's trial found it there
    # alone), with what to change where the step reads its loss's value.
    summary = summary_text(monitor.report, width=10_000)
    line = next(line for line in summary.splitlines() if "advice modelled" in line)
    assert line.startswith("  advice modelled, the step not replayed (the Markdown report says more): the step reads")
    assert "keep loss.detach() and read it after the step" in line


def plain_run(session: VramSession, model: nn.Module, step_function: Any = None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session.start(model, optimizers=[optimizer], step_function=step_function)
    data = loader(dataset_for("linear"))
    for step, (inputs, targets) in enumerate(data):
        if step == 3:
            break
        session.batch_start((inputs, targets))
        loss = nn.functional.cross_entropy(model(inputs), targets)
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        session.batch_end()
    session.finish()


def test_a_plain_loop_replays_with_a_step_function_and_says_why_not_without() -> None:
    without = VramSession(attribution_start_step=1, console_summary=False)
    plain_run(without, linear_net())
    assert without.simulation is not None and without.simulation.skipped is not None
    assert "pass step_function" in without.simulation.skipped

    def step_function(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(model(inputs), targets)

    with_step = VramSession(attribution_start_step=1, console_summary=False)
    plain_run(with_step, linear_net(), step_function)
    simulation = with_step.simulation
    assert simulation is not None and simulation.skipped is None
    assert simulation.match is not None and simulation.match.matches


def preflight_run(tmp_path: Path, free_bytes: int) -> tuple[VramMonitor, list[int], list[str]]:
    """A run on the scripted CUDA device; records how many monitor warnings existed when training_step first ran."""
    seen_at_first_step: list[int] = []
    caught: list[warnings.WarningMessage] = []

    class Recorder(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not seen_at_first_step and not torch._subclasses.fake_tensor.is_fake(batch[0]):
                seen_at_first_step.append(sum(issubclass(item.category, VramMonitorWarning) for item in caught))
            return super().training_step(batch, batch_idx)

    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], device=SCRIPTED_DEVICE, free_bytes=free_bytes)
    monitor = VramMonitor(probe=probe, console_summary=False, attribution_start_step=100)
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        caught = recorded
        trainer(tmp_path, [monitor], max_steps=2).fit(
            Recorder(cnn_net(), OPTIMIZERS["adam"]), loader(dataset_for("cnn"), batch_size=16)
        )
        messages = [str(item.message) for item in recorded if issubclass(item.category, VramMonitorWarning)]
    return monitor, [len(messages), *seen_at_first_step], messages


def test_preflight_warns_before_the_first_step_when_it_cannot_fit(tmp_path: Path) -> None:
    monitor, (warned, before_first_step), messages = preflight_run(tmp_path, free_bytes=64 * 1024)
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and not verdict.fits
    assert verdict.needed_bytes == verdict.step.peak.peak_bytes  # nothing allocated on the scripted device
    assert verdict.available_bytes == 64 * 1024
    assert warned == 1 and before_first_step == 1  # the warning came before training_step ran
    assert "batch size 8" in {remedy.label for remedy in verdict.remedies}  # half the batch of 16
    shortfall = verdict.needed_bytes - verdict.available_bytes
    assert f"predicted to run out of memory in {verdict.step.peak.phase.value} on Scripted GPU" in messages[0]
    assert f"{format_bytes(shortfall)} short" in messages[0]
    assert f"{verdict.remedies[0].label}: peak {format_bytes(verdict.remedies[0].peak_bytes)}" in messages[0]
    peaks = [remedy.peak_bytes for remedy in verdict.remedies]
    assert peaks == sorted(peaks) and all(peak < verdict.step.peak.peak_bytes for peak in peaks)


def test_preflight_stays_silent_when_the_step_fits(tmp_path: Path) -> None:
    monitor, (warned, before_first_step), _ = preflight_run(tmp_path, free_bytes=8 * 1024**3)
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and verdict.fits and verdict.remedies == ()
    assert warned == 0 and before_first_step == 0


def test_preflight_is_off_when_asked(tmp_path: Path) -> None:
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], free_bytes=1)
    monitor = VramMonitor(probe=probe, console_summary=False, preflight=False, attribution_start_step=100)
    trainer(tmp_path, [monitor], max_steps=1).fit(Classifier(cnn_net()), loader(dataset_for("cnn")))
    assert monitor.session.preflight_verdict is None


@pytest.mark.parametrize("value", [-1.0, float("nan"), 3601.0, "10"])
def test_the_replay_budget_is_checked_at_construction(value: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="replay_budget_seconds must be a number of seconds"):
        VramMonitor(replay_budget_seconds=value)
