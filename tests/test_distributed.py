"""Distributed training: a real two-process DDP run on the CPU (gloo), and the per-rank file names."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_vram.oom import report_stem


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_process_ddp_reduces_over_ranks(tmp_path: Path, strategy: str) -> None:
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    script = Path(__file__).parent / "ddp_train.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), strategy],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "rank0.steps").read_text() == (tmp_path / "rank1.steps").read_text() == "4"
    (log_dir,) = (tmp_path / "ddp").iterdir()
    report = json.loads((log_dir / "vram_report.json").read_text())
    ranks = {rank["rank"]: rank for rank in report["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert ranks[1]["peak_bytes"] > ranks[0]["peak_bytes"]  # rank 1 doubles its batch
    assert ranks[0]["steps"] == ranks[1]["steps"] == 4
    assert report["peak"]["allocated_bytes"] == ranks[0]["peak_bytes"]  # rank zero's own report...
    spread = ranks[1]["peak_bytes"] - ranks[0]["peak_bytes"]
    assert "2 ranks: rank 1 peaked highest" in (log_dir / "vram_report.md").read_text()
    assert spread > 0
    rows = list(csv.DictReader((log_dir / "metrics.csv").read_text().splitlines()))
    peaks = [row for row in rows if row.get("vram/peak_bytes")]
    assert len(peaks) == 2  # every 2 of 4 steps: one gather per interval
    for row in peaks:
        per_rank = [float(row["vram/rank_0/peak_bytes"]), float(row["vram/rank_1/peak_bytes"])]
        assert float(row["vram/peak_bytes"]) == max(per_rank)  # ...while the logged scalar is the worst rank
        assert per_rank[1] > per_rank[0]
    assert not list(log_dir.glob("vram_oom_report*"))


def test_each_rank_writes_its_own_files() -> None:
    assert [report_stem("vram_oom_report", rank, 2) for rank in (0, 1)] == [
        "vram_oom_report.rank0",
        "vram_oom_report.rank1",
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_fsdp2_shards_count_what_each_rank_holds(tmp_path: Path) -> None:
    script = Path(__file__).parent / "shard_accounting.py"
    result = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        half = counts["full_bytes"] // 2  # every sharded dimension divides by 2
        assert counts["parameters"] == half == counts["local_elements"] * 4
        assert counts["gradients"] == half
        assert counts["optimizer_state"] == 2 * half + 4 * 4  # Adam's moments of the shard, four step counters
        assert counts["model_state"] == [half, half, 2 * half + 16]
