"""Every report written under schema ``lightning_vram.report/1`` reads back: earlier releases' files and our own.

``tests/data/reports/<release>/{cpu,cuda,empty}.json`` were written by the released code of each version (the commit
that set ``__version__``, exported with ``git archive`` and run in this project's environment): a CPU run of
``Classifier(linear_net())`` for 4 steps, a scripted-CUDA run for 6 steps with validation that fires
``near-capacity`` advice, and (0.7.0, the first release to write one) a run with no training step.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Classifier, dataset_for, linear_net, loader, trainer

from lightning_vram import VramMonitor
from lightning_vram.cli import load_report, main
from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.config import MAX_RECENT_STEPS, MAX_STEPS
from lightning_vram.records import Phase, StepPoint
from lightning_vram.render.files import write_report_files
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

RELEASES = Path(__file__).parent / "data" / "reports"
RELEASED_REPORTS = sorted(RELEASES.glob("*/*.json"))
MIB = 1024**2


def released(path: Path) -> str:
    return f"{path.parent.name}-{path.stem}"


def test_every_release_left_a_report_here() -> None:
    assert sorted({path.parent.name for path in RELEASED_REPORTS}) == sorted(f"0.{minor}.0" for minor in range(1, 11))


@pytest.mark.parametrize("path", RELEASED_REPORTS, ids=released)
def test_the_cli_reads_each_release_s_report(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(path.read_text())
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("VRAM report:")
    assert main(["html", str(path), "-o", str(tmp_path / "page.html")]) == 0
    assert main(["diff", str(path), str(path)]) == 0
    assert "advice: unchanged" in capsys.readouterr().out
    report = load_report(path)
    assert report.steps == data["steps"]
    assert [item.id for item in report.advice] == [item["id"] for item in data["advice"]]
    if data["peak"] is not None:
        assert report.peak is not None and report.peak.peak_bytes == data["peak"]["allocated_bytes"]
        assert f"in {report.peak.phase.value} of step {report.peak.step}" in shown
    for name, phase in data["phases"].items():
        assert report.phases[Phase(name)].peak_bytes == phase["peak_bytes"]


def test_fields_an_old_release_did_not_write_read_as_their_defaults() -> None:
    data = json.loads((RELEASES / "0.1.0" / "cuda.json").read_text())
    report = report_from_dict(data)
    assert report.device.compute_capability is None and report.precision is None and report.batch_size is None
    assert report.fit == () and report.recent_peaks == () and report.evaluation == ()
    assert report.recovered_ooms is None and report.simulation is None
    for path in RELEASED_REPORTS:  # no release recorded what checkpointing recomputed, or priced an advice's time
        assert load_report(path).recomputed_units is None
        costs = [(item.estimated_cost_seconds, item.flop_ratio, item.cost_basis) for item in load_report(path).advice]
        assert costs == [(None, None, None)] * len(costs)
    assert report.peak is not None
    for peak in report.phases.values():  # 0.1.0 did not record a phase's step or reserve
        assert peak.step == report.peak.step and peak.reserved_bytes is None


# ------------------------------------------------------------------------------- what the monitor writes, read back


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self(inputs), targets)


def near_capacity_steps(steps: int) -> list[ScriptedBoundary]:
    """A 16 GiB scripted GPU that the backward pass nearly fills (``near-capacity`` advice fires)."""
    reserved = 15 * 1024 * MIB
    one_step = [
        ScriptedBoundary(100 * MIB, reserved, 100 * MIB),
        ScriptedBoundary(14000 * MIB, reserved, 15000 * MIB),
        ScriptedBoundary(200 * MIB, reserved, 15500 * MIB),
        ScriptedBoundary(100 * MIB, reserved, 300 * MIB),
    ]
    return one_step * steps


def write_report(root: Path, shape: str) -> Path:
    """Train one run of ``shape`` with the current monitor; the ``vram_report.json`` it wrote."""
    torch.manual_seed(0)
    data = loader(dataset_for("linear"))
    options: dict[str, Any] = {"console_summary": False, "attribution_start_step": 1}
    if shape == "empty":
        trainer(root, [VramMonitor(**options)], max_steps=0).fit(Classifier(linear_net()), data)
    elif shape == "cpu":
        trainer(root, [VramMonitor(**options)], max_steps=4).fit(Classifier(linear_net()), data)
    else:
        monitor = VramMonitor(probe=ScriptedProbe(near_capacity_steps(6)), **options)
        validation = {"limit_val_batches": 2, "val_check_interval": 3, "num_sanity_val_steps": 0}
        trainer(root, [monitor], max_steps=6, **validation).fit(Validated(linear_net()), data, data)
        assert monitor.report is not None and monitor.report.advice and monitor.report.evaluation
        assert monitor.report.simulation is not None
    return root / "vram_report.json"


@pytest.mark.replay  # the report read back whole, its simulation section included
@pytest.mark.parametrize("shape", ["empty", "cpu", "scripted-cuda"])
def test_the_monitor_writes_no_report_its_cli_refuses(shape: str, tmp_path: Path) -> None:
    path = write_report(tmp_path / "run", shape)
    data = json.loads(path.read_text())
    assert main(["show", str(path)]) == 0
    assert main(["html", str(path), "-o", str(tmp_path / "page.html")]) == 0
    assert report_to_dict(load_report(path)) == data  # nothing the file says is lost on the way back
    # A sampled step recorded that nothing was recomputed; a run without one did not record it.
    assert data["recomputed_units"] == (None if shape == "empty" else [])


@pytest.mark.replay  # the report read back whole, its simulation section included
def test_a_report_with_the_most_recent_peaks_the_monitor_keeps_reads_back(tmp_path: Path) -> None:
    report = load_report(write_report(tmp_path / "run", "cpu"))
    last = MAX_STEPS  # the step count at which options stop: every number at its widest
    points = tuple(StepPoint(step, 2**47) for step in range(last - MAX_RECENT_STEPS, last))
    largest = replace(report, summary=replace(report.summary, recent_peaks=points))
    path = write_report_files(largest, tmp_path / "largest")
    assert isinstance(path, Path)
    assert main(["show", str(path)]) == 0
