"""The sampled step calibrates the replay: measured beside replayed per phase, and what the replay cannot see carried.

The CUDA path runs through the scripted probe: the allocator's readings are scripted, the tensors and the replay are
real (on the CPU, with the allocator's settings passed explicitly, so reserved figures are simulated).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader, trainer
from scripted import MIB

from lightning_vram import VramMonitor
from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.calibration import calibrate, carry
from lightning_vram.records import (
    Breakdown,
    Calibration,
    Phase,
    PhaseCalibration,
    PhasePeak,
    ReplayedStep,
    Simulation,
)
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown as render_markdown
from lightning_vram.render.text import summary_text
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

pytestmark = pytest.mark.replay  # the calibration is the replay's

UNSEEN = {Phase.FORWARD: 64 * MIB, Phase.BACKWARD: 48 * MIB, Phase.OPTIMIZER: 0}
"""What the scripted allocator holds beyond the replay in each phase of the sampled step."""


def _steps(peaks: dict[Phase, int], reserved: int, steps: int = 4) -> list[ScriptedBoundary]:
    """Four reads a step, each phase peaking at ``peaks``: batch start, before backward, before the optimizer, end."""
    boundary = [
        ScriptedBoundary(0, reserved, 0),
        ScriptedBoundary(0, reserved, peaks[Phase.FORWARD]),
        ScriptedBoundary(0, reserved, peaks[Phase.BACKWARD]),
        ScriptedBoundary(0, reserved, peaks[Phase.OPTIMIZER]),
    ]
    return boundary * steps


def _fit(root: Path, probe: ScriptedProbe) -> VramMonitor:
    torch.manual_seed(0)
    monitor = VramMonitor(probe=probe, attribution_start_step=1, console_summary=False)
    trainer(root, [monitor], max_steps=4).fit(
        Classifier(cnn_net(), OPTIMIZERS["adam"]), loader(dataset_for("cnn"), batch_size=16)
    )
    return monitor


def _simulation(monitor: VramMonitor) -> Simulation:
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None and simulation.calibration is not None
    return simulation


def test_the_sampled_step_s_excess_is_in_the_report_and_carried_into_every_variant(tmp_path: Path) -> None:
    # First the replay's own peaks: an allocator that never reads above the replay carries nothing.
    plain = _simulation(_fit(tmp_path / "plain", ScriptedProbe(_steps(dict.fromkeys(Phase, 0), 0))))
    calibration = plain.calibration
    assert calibration is not None and not calibration.carries
    replayed = {phase.phase: phase.replayed_allocated_bytes for phase in calibration.phases}
    assert set(replayed) == set(Phase) and all(value > 0 for value in replayed.values())
    assert plain.allocator_conf == ""  # torch's defaults, from the environment
    # Every replayed storage is under 1 MiB: one 2 MiB small-pool segment holds each phase.
    assert [phase.replayed_reserved_bytes for phase in calibration.phases] == [2 * MIB] * 3

    # Then an allocator that holds UNSEEN more in each phase of the sampled step.
    measured = {phase: replayed[phase] + UNSEEN[phase] for phase in Phase}
    monitor = _fit(tmp_path / "unseen", ScriptedProbe(_steps(measured, 600 * MIB)))
    simulation = _simulation(monitor)
    calibration = simulation.calibration
    assert calibration is not None and calibration.step == 1
    assert calibration.unseen_bytes == UNSEEN
    assert [(p.measured_allocated_bytes, p.measured_reserved_bytes) for p in calibration.phases] == [
        (measured[phase], 600 * MIB) for phase in Phase
    ]
    assert calibration.unseen_reserved_bytes == dict.fromkeys(Phase, 598 * MIB)
    # The baseline and each variant carry the excess, phase by phase, on top of what they replayed.
    assert simulation.baseline is not None
    assert {phase: peak.peak_bytes for phase, peak in simulation.baseline.phases.items()} == measured
    before = {variant.change: variant.replayed for variant in plain.variants}
    assert simulation.variants
    for variant in simulation.variants:
        assert variant.replayed is not None, variant.discarded
        old = before[variant.change]
        assert old is not None
        for phase, peak in variant.replayed.phases.items():
            assert peak.peak_bytes == old.phases[phase].peak_bytes + UNSEEN[phase]
            assert peak.reserved_bytes == old.phases[phase].reserved_bytes + 598 * MIB
        assert "carried into this prediction: 64.0 MiB in forward, 48.0 MiB in backward" in variant.replayed.notes[-1]

    report = monitor.report
    assert report is not None and report.simulation == simulation
    read_back = report_from_dict(report_to_dict(report)).simulation  # the JSON both ways
    assert read_back is not None
    assert (read_back.calibration, read_back.allocator_conf, read_back.expandable_reserved_bytes) == (
        calibration,
        "",
        dict.fromkeys(Phase, 2 * MIB),
    )
    section = report_to_dict(report)["simulation"]
    assert isinstance(section, dict)
    assert section["calibration"]["phases"][0]["unseen_bytes"] == 64 * MIB
    markdown = render_markdown(report)
    assert "the replay's error" in markdown
    forward = calibration.phases[0]
    share = (forward.replayed_allocated_bytes - forward.measured_allocated_bytes) / forward.measured_allocated_bytes
    assert f"{share:+.2%}" in markdown
    assert "112.0 MiB in all" in markdown  # 64 + 48 MiB carried
    assert "(replayed + carried)" in markdown  # the baseline's table says its peaks carry the excess
    summary = summary_text(report)
    assert f"the replay's error on step 1: forward {share:+.2%} allocated" in summary
    assert "carried into predictions: 112.0 MiB" in summary
    page = render_html(report)
    assert 'id="simulation-calibration"' in page and f"{share:+.2%}" in page


def test_a_cpu_run_has_no_calibration(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(cnn_net()), loader(dataset_for("cnn"), batch_size=16))
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None
    assert simulation.calibration is None and simulation.allocator_conf is None
    assert simulation.expandable_reserved_bytes is None
    assert simulation.baseline is not None
    assert all(peak.reserved_bytes is None for peak in simulation.baseline.phases.values())


def _step(peaks: dict[Phase, tuple[int, int | None]]) -> ReplayedStep:
    phases = {
        phase: PhasePeak(1, phase, allocated, reserved, Breakdown(10, 10, 0, 0, allocated - 20))
        for phase, (allocated, reserved) in peaks.items()
    }
    return ReplayedStep("cuda", "32-true", 8, phases, (), 0, 0.0)


def test_what_the_replay_over_counts_is_never_carried_back() -> None:
    replayed = _step({Phase.FORWARD: (1000, 4096), Phase.BACKWARD: (2000, 4096)})
    measured = {
        Phase.FORWARD: PhasePeak(1, Phase.FORWARD, 1500, 3072, None),  # above the replay's allocated, below reserved
        Phase.BACKWARD: PhasePeak(1, Phase.BACKWARD, 1900, 8192, None),  # below the replay's allocated
    }
    calibration = calibrate(replayed, measured, 1)
    assert calibration == Calibration(
        1,
        (
            PhaseCalibration(Phase.FORWARD, 1000, 1500, 4096, 3072),
            PhaseCalibration(Phase.BACKWARD, 2000, 1900, 4096, 8192),
        ),
    )
    assert calibration.unseen_bytes == {Phase.FORWARD: 500, Phase.BACKWARD: 0}
    assert calibration.unseen_reserved_bytes == {Phase.FORWARD: 0, Phase.BACKWARD: 4096}
    assert calibration.phases[0].allocated_error == -500 / 1500
    assert calibration.phases[1].reserved_error == -0.5
    carried = carry(replayed, calibration)
    forward, backward = carried.phases[Phase.FORWARD], carried.phases[Phase.BACKWARD]
    assert (forward.peak_bytes, forward.reserved_bytes) == (1500, 4096)
    assert (backward.peak_bytes, backward.reserved_bytes) == (2000, 8192)
    assert forward.breakdown is not None and forward.breakdown.other == 1480  # the carried bytes are in "other"
    nothing = calibrate(replayed, {Phase.FORWARD: PhasePeak(1, Phase.FORWARD, 10, None, None)}, 1)
    assert nothing is not None and carry(replayed, nothing) is replayed


class StepReserves:
    """The part of a simulation's replays :func:`at_step` reads: the allocator, and a step's reserve by its index."""

    allocator = AllocatorSettings()

    def __init__(self, by_steps_before: dict[int, dict[Phase, int]]) -> None:
        self.by_steps_before = by_steps_before

    def reserved_with(self, settings: AllocatorSettings, steps_before: int | None = None) -> dict[Phase, int] | None:
        return self.by_steps_before[2 if steps_before is None else min(steps_before, 2)]


def test_a_sampled_step_is_set_against_the_reserve_its_own_index_holds() -> None:
    """The replay's reserved peaks are a steady step's (step 2 on); a step sampled at 1 is set against step 1's."""
    from lightning_vram.prediction.replay.simulation import at_step

    replayed = _step({Phase.FORWARD: (1000, 8192), Phase.BACKWARD: (2000, 8192)})
    reserves = StepReserves(
        {1: {Phase.FORWARD: 6144, Phase.BACKWARD: 8192}, 2: {Phase.FORWARD: 8192, Phase.BACKWARD: 8192}}
    )
    first_sampled = at_step(replayed, reserves, 1)  # type: ignore[arg-type]  # the two members at_step reads
    assert {phase: peak.reserved_bytes for phase, peak in first_sampled.phases.items()} == {
        Phase.FORWARD: 6144,
        Phase.BACKWARD: 8192,
    }
    assert at_step(replayed, reserves, 3) == replayed  # type: ignore[arg-type]
    measured = {Phase.FORWARD: PhasePeak(1, Phase.FORWARD, 1000, 6144, None)}
    calibration = calibrate(first_sampled, measured, 1)
    assert calibration is not None and calibration.phases[0].reserved_error == 0.0
