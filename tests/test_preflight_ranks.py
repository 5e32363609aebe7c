"""Preflight on every rank before step 0, each with its own prediction, and one gather to agree (issue 26, item 7).

Two gloo ranks on the CPU, each monitor on a scripted CUDA device with the same free memory (``ScriptedProbe``): rank
1's step is larger, so at the capacity chosen rank 0's first step fits and rank 1's does not. Every rank holds the
same agreed rows and warns the same sentence naming rank 1 with its figures; rank 1 adds its own remedies. A rank
whose preflight is skipped still joins the gather (carrying "skipped"), so no rank waits for ever. Training is the
same with and without the monitor on both ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import preloaded_python
import pytest
from test_distributed import HANG, free_port

from lightning_vram.units import format_bytes

pytestmark = [pytest.mark.distributed, pytest.mark.replay]

WORLD = 2
DDP_FREE = 10 * 1024**2
"""Free bytes on each DDP rank's scripted device: rank 0's step needs 7,952,512 B here, rank 1's 13,244,544 B."""
DDP_TIGHT = 4 * 1024**2
"""Free bytes for the run where rank 1's preflight is skipped: rank 0's step does not fit."""
ZERO_FREE = 1_228_800
"""Free bytes on each ZeRO rank's scripted device: rank 0's step needs 1,095,548 B here, rank 1's 1,357,692 B (ZeRO-2;
ZeRO-3: 1,015,528 B and 1,277,672 B)."""


def run_script(script: str, *arguments: str) -> None:
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    result = preloaded_python.run_script(Path(__file__).parent / script, *arguments, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]


def read(path: Path) -> Any:
    return json.loads(path.read_text())


def agreed_line(rows: list[list[Any]], owner: str) -> str:
    """The sentence every rank warns, from the agreed rows (rank 1 short, rank 0 fitting), naming ``owner`` (the object
    the script made: ``VramMonitor`` under a Trainer, ``VramSession`` in a plain loop)."""
    (_, _, needed, available, _) = rows[1]
    return (
        f"{owner}: preflight on 2 ranks before step 0: 1 of 2 ranks predicted to run out of memory: rank 1 needs"
        f" {format_bytes(needed)} more, {format_bytes(available)} available ({format_bytes(needed - available)}"
        " short). Predicted to fit: rank 0."
    )


def check_agreement(records: list[dict[str, Any]], free: int) -> list[list[Any]]:
    """Both ranks hold the same rows: rank 0 fits, rank 1 does not, each row its own rank's own verdict."""
    rows = records[0]["agreed"]
    assert records[1]["agreed"] == rows
    for rank, record in enumerate(records):
        fits, needed, available = record["own"]
        assert rows[rank] == [rank, fits, needed, available, needed]  # nothing allocated on the scripted device
        print(f"rank {rank}: needs {needed:,} B of {available:,} B free: {'fits' if fits else 'does not fit'}")
    assert [row[1] for row in rows] == [True, False]
    assert rows[0][2] < free < rows[1][2] and rows[0][3] == rows[1][3] == free
    return rows


def test_ddp_ranks_agree_on_one_preflight_verdict_and_train_unchanged(tmp_path: Path) -> None:
    monitored, bare = tmp_path / "monitored", tmp_path / "bare"
    monitored.mkdir()
    bare.mkdir()
    run_script("preflight_ranks_train.py", str(monitored), str(DDP_FREE))
    run_script("preflight_ranks_train.py", str(bare), str(DDP_FREE), "no-monitor")
    records = [read(monitored / f"preflight{rank}.json") for rank in range(WORLD)]
    rows = check_agreement(records, DDP_FREE)
    line = agreed_line(rows, "VramMonitor")
    assert records[0]["warnings"] == [line]  # rank 0 fits, and names rank 1
    (own,) = records[1]["warnings"]
    assert own.startswith(f"{line} Rank 1's own check: the first training step is predicted to run out of memory")
    assert "Replayed changes that fit, largest saving first: batch size 256" in own
    assert {record["strategy"] for record in records} == {"DDP gradient buckets"}  # each rank's buckets held
    for rank in range(WORLD):
        assert read(monitored / f"training{rank}.json") == read(bare / f"training{rank}.json"), rank


def test_a_rank_whose_preflight_is_skipped_still_joins_the_gather(tmp_path: Path) -> None:
    # Rank 1 reads its loss's value in its step: its replay cannot run, so its preflight is skipped; it joins the
    # gather all the same (rank 0 would otherwise wait there for ever), and both ranks agree on the rows.
    run_script("preflight_ranks_train.py", str(tmp_path), str(DDP_TIGHT), "rank1-skips")
    records = [read(tmp_path / f"preflight{rank}.json") for rank in range(WORLD)]
    rows = records[0]["agreed"]
    assert records[1]["agreed"] == rows
    fits, needed, available = records[0]["own"]
    assert not fits
    assert rows == [[0, False, needed, DDP_TIGHT, needed], [1, None, None, None, None]]
    assert needed > available == DDP_TIGHT
    assert records[1]["own"] is None
    assert records[1]["skipped"][1].startswith("the step reads a tensor's value")
    line = (
        "VramMonitor: preflight on 2 ranks before step 0: 1 of 2 ranks predicted to run out of memory: rank 0 needs"
        f" {format_bytes(needed)} more, {format_bytes(DDP_TIGHT)} available ({format_bytes(needed - DDP_TIGHT)}"
        " short). Not checked (preflight skipped there): rank 1."
    )
    assert records[1]["warnings"] == [line]
    (own,) = records[0]["warnings"]
    assert own.startswith(f"{line} Rank 0's own check: ")


def test_zero_ranks_agree_on_their_own_predictions_and_train_unchanged(tmp_path: Path) -> None:
    # One process start per rank trains ZeRO-2 with the session and without it, then ZeRO-3 with it and without it.
    run_script("preflight_zero_train.py", str(free_port()), str(tmp_path), str(ZERO_FREE))
    records = [read(tmp_path / f"zero2-preflight{rank}.json") for rank in range(WORLD)]
    rows = check_agreement(records, ZERO_FREE)
    line = agreed_line(rows, "VramSession")
    assert records[0]["warnings"] == [line]
    (own,) = records[1]["warnings"]
    assert own.startswith(f"{line} Rank 1's own check: the first training step is predicted to run out of memory")
    for record in records:  # each rank's prediction is ZeRO-2's arithmetic for that rank (RankReplays)
        assert record["notes"][-1].startswith("deepspeed_stage_2 x2: arithmetic on the single-process replay")
    for rank in range(WORLD):
        assert read(tmp_path / f"zero2-training{rank}.json") == read(tmp_path / f"bare2-training{rank}.json"), rank
    # A live ZeRO-3 rank is predicted too: its replay copies the module's partitioned parameters whole (ds_shape),
    # without DeepSpeed's hooks, and ZeRO-3's arithmetic gives the rank's figures; the ranks agree the same way.
    zero3 = [read(tmp_path / f"zero3-preflight{rank}.json") for rank in range(WORLD)]
    rows = check_agreement(zero3, ZERO_FREE)
    line = agreed_line(rows, "VramSession")
    assert zero3[0]["warnings"] == [line]
    assert zero3[1]["warnings"][0].startswith(f"{line} Rank 1's own check: ")
    for record in zero3:
        assert record["skipped"] == [None, None]
        assert record["notes"][-1].startswith("deepspeed_stage_3 x2: arithmetic on the single-process replay")
    for rank in range(WORLD):
        trained, bare = read(tmp_path / f"zero3-training{rank}.json"), read(tmp_path / f"bare3-training{rank}.json")
        assert trained["partitions"] and trained["master"]  # this rank's ZeRO-3 partitions, compared whole
        assert trained == bare, rank
