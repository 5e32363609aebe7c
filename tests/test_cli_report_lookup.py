"""Which report ``lightning-vram show DIR`` and ``diff A B`` read for a directory: a rule the user can predict.

A new user's trial: given a directory, the command read the newest ``vram_report.json`` anywhere below it, so
``show lightning_logs/`` could show an unrelated run nested deeper, and ``diff runA runB`` compared a sub-run of runA.
Now a directory's own report is read (silently); without one, the reports nearest below it, and of several the one in
the highest ``version_N`` folder (Lightning's latest run of a logger), then the newest; the file read is named on
stderr. The layouts here are the monitor's own (a CSV logger's ``lightning_logs/version_N``, written by real runs) and
copies of the reports kept under tests/data/reports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from models import Classifier, dataset, loader, mlp, trainer

from lightning_vram import Report, VramMonitor
from lightning_vram.cli import main
from lightning_vram.units import format_bytes

REPORTS = Path(__file__).parent / "data" / "reports" / "0.10.0"
CPU_HEADLINE = "VRAM report: x86_64 (cpu), 4 steps"
CUDA_HEADLINE = "VRAM report: Scripted GPU (cuda), 6 steps"


def logged_run(root: Path, batch_size: int) -> Report:
    """A short run whose CSV logger writes ``root/lightning_logs/version_N``, the report with it."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    logger = CSVLogger(root, name="lightning_logs")
    trainer(root, [monitor], max_steps=2, logger=logger).fit(
        Classifier(mlp(64, 2)), loader(dataset(64, 64), batch_size)
    )
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


def placed(source: str, path: Path, mtime: float) -> Path:
    """Fixture report ``source`` copied to ``path`` (a ``vram_report.json``), modified at ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPORTS / f"{source}.json", path)
    os.utime(path, (mtime, mtime))
    return path


def test_a_log_dir_of_several_versions_reads_the_highest_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = logged_run(tmp_path, 32), logged_run(tmp_path, 8)
    logs = tmp_path / "lightning_logs"
    assert sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("vram_report.json")) == [
        "lightning_logs/version_0/vram_report.json",
        "lightning_logs/version_1/vram_report.json",
    ]
    assert first.peak is not None and second.peak is not None and first.peak.peak_bytes != second.peak.peak_bytes
    os.utime(logs / "version_1" / "vram_report.json", (1, 1))  # copied without its times: version_1 looks older
    newest = format_bytes(second.peak.peak_bytes)
    for given, levels in ((logs, "1 level"), (tmp_path, "2 levels")):
        assert main(["show", str(given)]) == 0
        captured = capsys.readouterr()
        assert f"Live peak {newest}" in captured.out
        assert captured.err == (
            f"lightning-vram: reading {logs / 'version_1' / 'vram_report.json'}"
            f" (the highest version_N of 2 reports {levels} below {given})\n"
        )
    assert main(["show", str(logs / "version_0")]) == 0  # a run's own log dir: its report, nothing said
    captured = capsys.readouterr()
    assert f"Live peak {format_bytes(first.peak.peak_bytes)}" in captured.out and captured.err == ""


def test_versions_compare_as_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    placed("cpu", tmp_path / "version_9" / "vram_report.json", 2_000_000)
    chosen = placed("cuda", tmp_path / "version_10" / "vram_report.json", 1_000_000)
    assert main(["show", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(CUDA_HEADLINE)
    assert (
        captured.err
        == f"lightning-vram: reading {chosen} (the highest version_N of 2 reports 1 level below {tmp_path})\n"
    )


def test_a_directory_s_own_report_beats_newer_ones_below_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_a = tmp_path / "runA"
    placed("cpu", run_a / "vram_report.json", 1_000_000)
    placed("cuda", run_a / "sweep" / "lightning_logs" / "version_3" / "vram_report.json", 2_000_000)  # newer
    assert main(["show", str(run_a)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(CPU_HEADLINE) and captured.err == ""
    # diff A B: run A's own report, set against B's (the cuda report): the devices of both are named.
    run_b = placed("cuda", tmp_path / "runB" / "vram_report.json", 3_000_000).parent
    assert main(["diff", str(run_a), str(run_b)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "x86_64" in captured.out and "Scripted GPU" in captured.out


def test_a_run_beats_a_run_nested_deeper_in_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    own = placed("cpu", tmp_path / "lightning_logs" / "version_0" / "vram_report.json", 1_000_000)
    nested = tmp_path / "lightning_logs" / "version_0" / "probe" / "version_7" / "vram_report.json"
    placed("cuda", nested, 2_000_000)  # newer, and in a higher version
    assert main(["show", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(CPU_HEADLINE)
    assert captured.err == f"lightning-vram: reading {own}\n"  # the only one at its level: named, no rule needed


def test_reports_outside_version_folders_go_by_the_newest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    placed("cpu", tmp_path / "runs" / "a" / "vram_report.json", 2_000_000)
    placed("cuda", tmp_path / "runs" / "b" / "vram_report.json", 1_000_000)
    assert main(["show", str(tmp_path / "runs")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(CPU_HEADLINE)
    assert captured.err == (
        f"lightning-vram: reading {tmp_path / 'runs' / 'a' / 'vram_report.json'}"
        f" (the newest of 2 reports 1 level below {tmp_path / 'runs'})\n"
    )
