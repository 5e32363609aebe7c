"""``lightning-vram diff`` when the peak moved to another phase: said so, and each phase compared with itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from advice_summaries import MIB, healthy_summary

from lightning_vram.cli import main
from lightning_vram.records import Breakdown, Phase, PhasePeak, Report


def phase_peak(phase: Phase, breakdown: Breakdown) -> PhasePeak:
    total = sum(value or 0 for value in breakdown.to_dict().values())
    return PhasePeak(step=3, phase=phase, peak_bytes=total, reserved_bytes=None, breakdown=breakdown)


def report(phases: dict[Phase, PhasePeak]) -> Report:
    highest = max(phases.values(), key=lambda peak: peak.peak_bytes)
    summary = healthy_summary(peak=highest, phases=phases)
    return Report(summary=summary, precision="32-true", modules=(), advice=(), fit=(), ranks=())


def write(report: Report, path: Path) -> Path:
    path.write_text(json.dumps(report.to_dict()))
    return path


def test_a_peak_that_moved_compares_each_phase_with_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the peak is in backward, with 300 MiB of activations. After (activations checkpointed): backward
    # holds 50 MiB of activations and the optimizer step, with no activations at all, is now the highest.
    model = {"parameters": 100 * MIB, "gradients": 100 * MIB, "optimizer_state": 200 * MIB}
    before = report(
        {
            Phase.BACKWARD: phase_peak(Phase.BACKWARD, Breakdown(**model, activations=300 * MIB, other=0)),
            Phase.OPTIMIZER: phase_peak(Phase.OPTIMIZER, Breakdown(**model, activations=0, other=20 * MIB)),
        }
    )
    after = report(
        {
            Phase.BACKWARD: phase_peak(Phase.BACKWARD, Breakdown(**model, activations=50 * MIB, other=0)),
            Phase.OPTIMIZER: phase_peak(Phase.OPTIMIZER, Breakdown(**model, activations=0, other=100 * MIB)),
        }
    )
    assert main(["diff", str(write(before, tmp_path / "a.json")), str(write(after, tmp_path / "b.json"))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "peak: 700.0 MiB -> 500.0 MiB: -200.0 MiB (-28.6%)"
    assert lines[1] == (
        "  the peak moved from backward to optimizer step: each phase is compared with itself below, part by part"
    )
    assert not any("-100" in line for line in lines)  # activations absent from the optimizer step were not freed
    assert lines[2:9] == [
        "  backward peak: 700.0 MiB -> 450.0 MiB: -250.0 MiB (-35.7%)",
        "    parameters: 100.0 MiB -> 100.0 MiB: +0 B (+0.0%)",
        "    gradients: 100.0 MiB -> 100.0 MiB: +0 B (+0.0%)",
        "    optimizer state: 200.0 MiB -> 200.0 MiB: +0 B (+0.0%)",
        "    activations: 300.0 MiB -> 50.0 MiB: -250.0 MiB (-83.3%)",
        "    other: 0 B -> 0 B: +0 B",
        "  optimizer peak: 420.0 MiB -> 500.0 MiB: +80.0 MiB (+19.0%)",
    ]
    assert "    other: 20.0 MiB -> 100.0 MiB: +80.0 MiB (+400.0%)" in lines


def test_a_peak_in_the_same_phase_compares_the_parts_at_the_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = {"parameters": 100 * MIB, "gradients": 100 * MIB, "optimizer_state": 0}
    before = report({Phase.BACKWARD: phase_peak(Phase.BACKWARD, Breakdown(**model, activations=300 * MIB, other=0))})
    after = report({Phase.BACKWARD: phase_peak(Phase.BACKWARD, Breakdown(**model, activations=100 * MIB, other=0))})
    assert main(["diff", str(write(before, tmp_path / "a.json")), str(write(after, tmp_path / "b.json"))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "moved" not in "\n".join(lines)
    assert "  activations: 300.0 MiB -> 100.0 MiB: -200.0 MiB (-66.7%)" in lines
