"""The CUDA code path on any machine, driven through the public ScriptedProbe; tensor counting stays real."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger
from models import FLOAT32, OPTIMIZERS, PARAMETER_COUNTS, Classifier, dataset_for, linear_net, loader, trainer
from scripted import MIB, scripted_steps

from lightning_vram import VramMonitor
from lightning_vram.measure.probes import too_short_for_utilization
from lightning_vram.records import NotMeasured, Phase, UtilizationReading
from lightning_vram.render.text import timing_line
from lightning_vram.session.recorder import PHASE_READ_STEPS
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

STEPS = [(300 * MIB, 350 * MIB, 200 * MIB), (320 * MIB, 340 * MIB, 210 * MIB), (310 * MIB, 330 * MIB, 400 * MIB)]


def run(tmp_path: Path, probe: ScriptedProbe, **monitor_options: object) -> VramMonitor:
    options = {"attribution_start_step": 100, "console_summary": False, **monitor_options}
    monitor = VramMonitor(probe=probe, **options)  # type: ignore[arg-type]
    trainer(tmp_path, [monitor], max_steps=len(STEPS)).fit(Classifier(linear_net()), loader(dataset_for("linear")))
    return monitor


def test_phase_peaks_come_from_the_allocator_at_each_boundary(tmp_path: Path) -> None:
    probe = ScriptedProbe(scripted_steps(STEPS))
    monitor = run(tmp_path, probe)
    report = monitor.report
    assert report is not None
    assert probe.reads == 4 * len(STEPS)
    assert probe.resets == probe.reads  # reset_peak_stats=True resets at every boundary
    assert report.phases[Phase.FORWARD].peak_bytes == 320 * MIB
    assert report.phases[Phase.FORWARD].step == 1
    assert report.phases[Phase.BACKWARD].peak_bytes == 350 * MIB
    assert report.phases[Phase.OPTIMIZER].peak_bytes == 400 * MIB
    assert report.peak is not None
    assert (report.peak.step, report.peak.phase, report.peak.peak_bytes) == (2, Phase.OPTIMIZER, 400 * MIB)
    # Reserved is read at the end of the peak phase, allocated is the peak: two different numbers.
    assert report.peak.reserved_bytes == 512 * MIB + 2 * MIB + MIB // 2
    assert report.device.name == "Scripted GPU"
    assert probe.closed


def test_without_reset_the_process_peak_is_left_alone(tmp_path: Path) -> None:
    probe = ScriptedProbe(scripted_steps(STEPS))
    report = run(tmp_path, probe, reset_peak_stats=False).report
    assert report is not None
    assert probe.resets == 0
    # Exact where a phase set a new process-wide peak (350 MiB in step 0's backward, 400 MiB in step 2's
    # optimizer step); elsewhere the higher boundary value is the lower bound it can prove.
    assert report.phases[Phase.BACKWARD].peak_bytes == 350 * MIB
    assert report.phases[Phase.OPTIMIZER].peak_bytes == 400 * MIB
    # Step 0's forward rose to 300 MiB. Steps 1 and 2 (320 and 310 MiB) stayed under the 350 MiB process
    # peak, so they only prove max(100, 110) MiB: the forward maximum stays step 0's, unlike with resets.
    forward = report.phases[Phase.FORWARD]
    assert (forward.step, forward.peak_bytes) == (0, 300 * MIB)


def test_other_is_the_measured_peak_beyond_the_counted_tensors(tmp_path: Path) -> None:
    probe = ScriptedProbe(scripted_steps(STEPS))
    report = run(tmp_path, probe, attribution_start_step=1, attribution_every_n_steps=None).report
    assert report is not None
    forward = report.phases[Phase.FORWARD]
    assert forward.step == 1 and forward.peak_bytes == 320 * MIB
    breakdown = forward.breakdown
    assert breakdown is not None
    parameter_bytes = PARAMETER_COUNTS["linear"] * FLOAT32
    assert (breakdown.parameters, breakdown.gradients, breakdown.optimizer_state) == (
        parameter_bytes,
        parameter_bytes,
        0,
    )
    assert breakdown.activations == 8 * 32 * FLOAT32 + 8 * 10 * FLOAT32 + 8 * 8 + FLOAT32
    assert breakdown.other == 320 * MIB - breakdown.counted_bytes
    # Steps measured before the first sample get its counts (the backward peak is step 0's).
    backward = report.phases[Phase.BACKWARD]
    assert backward.step == 0 and backward.breakdown is not None
    assert backward.breakdown.other == 350 * MIB - backward.breakdown.counted_bytes


def test_scalars_and_utilization_reach_the_logger(tmp_path: Path) -> None:
    probe = ScriptedProbe(
        scripted_steps(STEPS),
        utilization=[UtilizationReading(40.0, 700 * MIB), UtilizationReading(60.0, 720 * MIB)],
    )
    monitor = VramMonitor(probe=probe, log_every_n_steps=1, attribution_start_step=100, console_summary=False)
    logger = CSVLogger(tmp_path, name="csv")
    trainer(tmp_path, [monitor], max_steps=3, logger=logger).fit(
        Classifier(linear_net()), loader(dataset_for("linear"))
    )
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").read_text().splitlines()))
    assert [float(row["vram/phase_peak/forward_bytes"]) for row in rows] == [300 * MIB, 320 * MIB, 310 * MIB]
    assert [float(row["vram/peak_bytes"]) for row in rows] == [350 * MIB, 340 * MIB, 400 * MIB]
    assert [float(row["vram/allocated_bytes"]) for row in rows] == [100 * MIB] * 3
    assert [float(row["vram/reserved_bytes"]) for row in rows] == [512 * MIB + i * MIB + MIB // 2 for i in range(3)]
    assert [float(row["vram/gpu_utilization_percent"]) for row in rows] == [40.0, 60.0, 60.0]
    assert float(rows[0]["vram/process_memory_bytes"]) == 700 * MIB
    assert monitor.report is not None
    assert monitor.report.timing.gpu_utilization_mean == pytest.approx(50.0)


def test_failing_nvml_is_reported_and_everything_else_still_measured(tmp_path: Path) -> None:
    missing = NotMeasured("GPU utilization and process memory (NVML)", "NVML could not start: Driver Not Loaded")
    probe = ScriptedProbe(scripted_steps(STEPS), not_measured=[missing])
    report = run(tmp_path, probe).report
    assert report is not None
    assert report.timing.gpu_utilization_mean is None
    assert report.phases[Phase.OPTIMIZER].peak_bytes == 400 * MIB
    entries = report.to_dict()["not_measured"]
    assert {"what": missing.what, "reason": missing.reason} in entries


def test_optimizer_phase_only_on_batches_that_step(tmp_path: Path) -> None:
    probe = ScriptedProbe(scripted_steps([(300 * MIB, 350 * MIB, 200 * MIB)]))
    monitor = VramMonitor(probe=probe, attribution_start_step=100, console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=2, accumulate_grad_batches=2)
    fit.fit(Classifier(linear_net(), OPTIMIZERS["sgd"]), loader(dataset_for("linear")))
    # max_steps counts optimizer steps: 4 batches, of which 2 step. A batch that does not step has
    # three boundaries (start, before backward, end); one that steps has four.
    assert monitor.report is not None and monitor.report.steps == 4
    assert probe.reads == 3 + 4 + 3 + 4


BASE, RESERVED = 100 * MIB, 512 * MIB


def phase_by_phase(forward: int, backward: int, optimizer: int) -> list[ScriptedBoundary]:
    """The four reads of a step read phase by phase: batch start, before backward, before the optimizer, batch end."""
    return [
        ScriptedBoundary(BASE, RESERVED, BASE),
        ScriptedBoundary(BASE + 10 * MIB, RESERVED, forward),
        ScriptedBoundary(BASE + 20 * MIB, RESERVED, backward),
        ScriptedBoundary(BASE, RESERVED + MIB, optimizer),
    ]


def read_once(peak: int) -> list[ScriptedBoundary]:
    """The one read of a step read once (at its end, its peak reset at its start): ``peak`` is the step's."""
    return [ScriptedBoundary(BASE, RESERVED + MIB, peak)]


STEADY = phase_by_phase(300 * MIB, 350 * MIB, 200 * MIB) * PHASE_READ_STEPS
"""The run's first steps, all read phase by phase: backward peaks at 350 MiB."""


def run_steps(tmp_path: Path, probe: ScriptedProbe, steps: int, **options: object) -> VramMonitor:
    monitor = VramMonitor(probe=probe, attribution_start_step=100, console_summary=False, **options)  # type: ignore[arg-type]
    fit = trainer(tmp_path, [monitor], max_steps=steps, log_every_n_steps=50)
    fit.fit(Classifier(linear_net()), loader(dataset_for("linear")))
    return monitor


def test_ordinary_steps_read_the_allocator_once_and_a_new_peak_is_read_phase_by_phase_next(tmp_path: Path) -> None:
    # Steps 10, 12 and 13 are read once; 13 sets a new peak (380 MiB) which is credited to backward, the phase that
    # peaked on the last step read phase by phase (11); step 14 is read phase by phase because of it.
    script = [
        *STEADY,
        *read_once(360 * MIB),  # step 10: a new run peak, read once
        *phase_by_phase(300 * MIB, 360 * MIB, 200 * MIB),  # step 11: read phase by phase, the same bytes in backward
        *read_once(340 * MIB),  # step 12
        *read_once(380 * MIB),  # step 13: a new run peak, read once
        *phase_by_phase(300 * MIB, 340 * MIB, 390 * MIB),  # step 14: the optimizer step peaks
    ]
    probe = ScriptedProbe(script)
    report = run_steps(tmp_path / "whole", probe, 15).report
    assert report is not None and report.steps == 15
    assert probe.reads == 4 * PHASE_READ_STEPS + 1 + 4 + 1 + 1 + 4  # one read on each ordinary step
    assert probe.resets == probe.reads + 3  # each ordinary step also resets the peak at its start, reading nothing
    assert report.peak is not None
    assert (report.peak.step, report.peak.phase, report.peak.peak_bytes) == (14, Phase.OPTIMIZER, 390 * MIB)
    assert report.peak.reserved_bytes == RESERVED + MIB
    # Step 11 read 360 MiB in backward: its measured record replaces step 10's credited one at the same bytes.
    backward = report.phases[Phase.BACKWARD]
    assert (backward.step, backward.peak_bytes) == (13, 380 * MIB)  # credited: no later step read it phase by phase
    assert [point.peak_bytes for point in report.summary.recent_peaks][-5:] == [
        360 * MIB,
        360 * MIB,
        340 * MIB,
        380 * MIB,
        390 * MIB,
    ]
    assert [(peak.phase, peak.step) for peak in report.summary.last_step] == [
        (Phase.FORWARD, 14),
        (Phase.BACKWARD, 14),
        (Phase.OPTIMIZER, 14),
    ]


def test_a_peak_read_once_is_credited_then_confirmed_by_the_next_step(tmp_path: Path) -> None:
    credited = ScriptedProbe([*STEADY, *read_once(360 * MIB)])
    report = run_steps(tmp_path / "credited", credited, PHASE_READ_STEPS + 1).report
    assert report is not None and report.peak is not None
    assert (report.peak.step, report.peak.phase, report.peak.peak_bytes) == (10, Phase.BACKWARD, 360 * MIB)
    assert report.phases[Phase.BACKWARD] == report.peak
    confirmed = ScriptedProbe([*STEADY, *read_once(360 * MIB), *phase_by_phase(300 * MIB, 200 * MIB, 360 * MIB)])
    report = run_steps(tmp_path / "confirmed", confirmed, PHASE_READ_STEPS + 2).report
    assert confirmed.reads == 4 * PHASE_READ_STEPS + 1 + 4
    assert report is not None and report.peak is not None
    # Step 11 reached the same 360 MiB in the optimizer step: the run's peak is its, with the phase read.
    assert (report.peak.step, report.peak.phase, report.peak.peak_bytes) == (11, Phase.OPTIMIZER, 360 * MIB)
    assert report.phases[Phase.OPTIMIZER].peak_bytes == 360 * MIB


def test_sampled_steps_and_each_interval_end_are_read_phase_by_phase(tmp_path: Path) -> None:
    steady = phase_by_phase(300 * MIB, 350 * MIB, 200 * MIB)
    script = [*STEADY, *read_once(340 * MIB), *steady, *read_once(340 * MIB), *read_once(340 * MIB), *steady]
    probe = ScriptedProbe(script)
    monitor = VramMonitor(probe=probe, attribution_start_step=11, attribution_every_n_steps=None, console_summary=False)
    logger = CSVLogger(tmp_path, name="csv")
    fit = trainer(tmp_path, [monitor], max_steps=15, logger=logger, log_every_n_steps=5)
    fit.fit(Classifier(linear_net()), loader(dataset_for("linear")))
    # Step 11 is sampled and step 14 ends a log interval: both read phase by phase; 10, 12 and 13 once.
    assert probe.reads == 4 * PHASE_READ_STEPS + 1 + 4 + 1 + 1 + 4
    report = monitor.report
    assert report is not None and report.phases[Phase.FORWARD].breakdown is not None
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").read_text().splitlines()))
    assert [float(row["vram/phase_peak/forward_bytes"]) for row in rows] == [300 * MIB] * 3
    assert [float(row["vram/peak_bytes"]) for row in rows] == [350 * MIB] * 3


def test_utilization_of_a_run_shorter_than_the_sampling_interval_reads_not_applicable(tmp_path: Path) -> None:
    short = too_short_for_utilization(0.5)
    report = run(tmp_path, ScriptedProbe(scripted_steps(STEPS), not_measured=[short])).report
    assert report is not None and report.timing.gpu_utilization_mean is None
    assert timing_line(report).endswith("GPU utilization n/a (run shorter than the sampling interval of 0.5 s)")
    assert {"what": "GPU utilization", "reason": short.reason} in report.to_dict()["not_measured"]


def test_a_batch_that_accumulates_credits_its_peak_to_a_phase_it_ran(tmp_path: Path) -> None:
    # Under accumulate_grad_batches=2 every other batch runs no optimizer step (three reads when read phase by phase:
    # start, before backward, end). The optimizer step peaks on the batches that step; batch 10 accumulates, is read
    # once, and its new peak goes to backward, the phase it ended in, not to the optimizer step it never ran.
    accumulating = [*phase_by_phase(300 * MIB, 350 * MIB, 0)[:2], ScriptedBoundary(BASE, RESERVED, 350 * MIB)]
    stepping = phase_by_phase(300 * MIB, 350 * MIB, 400 * MIB)
    script = [*(accumulating + stepping) * (PHASE_READ_STEPS // 2), *read_once(500 * MIB), *stepping]
    probe = ScriptedProbe(script)
    monitor = VramMonitor(probe=probe, attribution_start_step=100, console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=PHASE_READ_STEPS // 2 + 1, accumulate_grad_batches=2)
    fit.fit(Classifier(linear_net(), OPTIMIZERS["sgd"]), loader(dataset_for("linear")))
    report = monitor.report
    assert report is not None and report.steps == PHASE_READ_STEPS + 2
    assert probe.reads == (3 + 4) * (PHASE_READ_STEPS // 2) + 1 + 4
    assert report.peak is not None
    assert (report.peak.step, report.peak.phase, report.peak.peak_bytes) == (10, Phase.BACKWARD, 500 * MIB)
    assert report.phases[Phase.OPTIMIZER].peak_bytes == 400 * MIB
