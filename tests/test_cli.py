"""The lightning-vram command on real reports and on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from models import Classifier, loader, trainer
from test_advice_end_to_end import dataset, mlp

from lightning_vram import Report, VramMonitor
from lightning_vram.cli import main
from lightning_vram.units import format_bytes


def run(root: Path, inplace: bool, batch_size: int) -> tuple[Report, Path]:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(
        Classifier(mlp(256, 8, inplace=inplace)), loader(dataset(256, 2048), batch_size)
    )
    assert monitor.report is not None
    return monitor.report, root


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Report, Path], tuple[Report, Path]]:
    before = run(tmp_path_factory.mktemp("before"), inplace=False, batch_size=512)
    after = run(tmp_path_factory.mktemp("after"), inplace=True, batch_size=256)
    return before, after


def test_show_a_log_dir_or_a_file(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    (report, root), _ = two_runs
    assert main(["show", str(root)]) == 0
    from_dir = capsys.readouterr().out
    assert from_dir.startswith("VRAM report:") and f"Peak {format_bytes(report.peak.peak_bytes)}" in from_dir  # type: ignore[union-attr]
    assert main(["show", str(root / "vram_report.json")]) == 0
    assert capsys.readouterr().out == from_dir


def test_html_writes_the_page(two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path) -> None:
    (_, root), _ = two_runs
    output = tmp_path / "page.html"
    assert main(["html", str(root), "-o", str(output)]) == 0
    assert output.read_text() == (root / "vram_report.html").read_text()


def test_diff_shows_what_changed(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    (before, before_root), (after, after_root) = two_runs
    assert main(["diff", str(before_root), str(after_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert before.peak is not None and after.peak is not None
    assert before.peak.breakdown is not None and after.peak.breakdown is not None
    saved = before.peak.peak_bytes - after.peak.peak_bytes
    assert saved > 0
    assert lines[0] == (
        f"peak: {format_bytes(before.peak.peak_bytes)} -> {format_bytes(after.peak.peak_bytes)}:"
        f" -{format_bytes(saved)} (-{saved / before.peak.peak_bytes:.1%})"
    )
    activations = next(line for line in lines if line.strip().startswith("activations:"))
    assert (
        f"{format_bytes(before.peak.breakdown.activations)} -> {format_bytes(after.peak.breakdown.activations)}"
        in activations
    )
    assert "  parameters: " in "\n".join(lines) and "+0 B (+0.0%)" in "\n".join(lines)
    assert "advice removed: inplace-activations" in lines


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file or directory"),
        ("{not json", "not JSON"),
        (json.dumps({"schema": "someone_else/2"}), "not a lightning_vram report"),
        (json.dumps({"schema": "lightning_vram.report/1", "steps": 3}), "missing field 'device'"),
        (json.dumps([1, 2]), "not a lightning_vram report"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "vram_report.json"
    if content is not None:
        path.write_text(content)
    assert main(["show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("lightning-vram: error: ") and message in captured.err
    assert captured.err.count("\n") == 1


def test_a_dir_without_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(tmp_path), str(tmp_path)]) == 2
    assert "no vram_report.json in this directory or below it" in capsys.readouterr().err


def test_the_installed_command(tmp_path: Path) -> None:
    (script,) = entry_points(group="console_scripts", name="lightning-vram")
    assert script.value == "lightning_vram.cli:main"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_vram.cli", "show", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
