"""The live sharded runs' shared steps (tests/test_fsdp1_live.py, tests/test_fsdp2_live.py): run a gloo training
script of tests/ on its ranks, read what each rank wrote, compare its training and its preflight."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fsdp2_live_train import WORLD_SIZE
from preloaded_python import run_script
from test_distributed import HANG


def run(script: str, out: Path, *mode: str) -> None:
    """Run ``script`` (a file of tests/) on its ranks, writing to ``out`` in ``mode``; it must succeed."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    result = run_script(Path(__file__).parent / script, str(out), *mode, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]


def read(path: Path) -> Any:
    """A record a rank wrote (JSON)."""
    return json.loads(path.read_text())


def monitored(script: str, out: Path, *mode: str) -> list[dict[str, Any]]:
    """Each rank's record (``rank<r>.json``) of a monitored run of ``script`` in ``mode`` made in ``out``."""
    out.mkdir(exist_ok=True)
    run(script, out, *mode)
    return [read(out / f"rank{rank}.json") for rank in range(WORLD_SIZE)]


def trained_apart(first: Path, second: Path) -> list[int]:
    """The ranks whose training (``training<r>.json``: losses, shards, optimizer state, RNG) differs between the
    runs made in ``first`` and ``second``."""
    return [
        rank
        for rank in range(WORLD_SIZE)
        if read(first / f"training{rank}.json") != read(second / f"training{rank}.json")
    ]


def check_preflight_agreed(out: Path, note: str, free_bytes: int, owner: str) -> None:
    """The ranks' preflight records in ``out`` (each rank's device ``free_bytes`` free, too few): both ranks agreed on
    the same rows, each row its rank's own verdict (replayed, its last note ``note``), each predicted not to fit,
    and each warned, naming ``owner`` (the object the script made), that both ranks run out of memory."""
    records = [read(out / f"preflight{rank}.json") for rank in range(WORLD_SIZE)]
    rows = records[0]["agreed"]
    assert records[1]["agreed"] == rows
    assert [row[0] for row in rows] == [0, 1]
    for rank, record in enumerate(records):
        assert record["skipped"] == [None, None]
        assert record["notes"][-1] == note
        fits, needed, available = record["own"]
        assert rows[rank] == [rank, fits, needed, available, needed]
        assert not fits and needed > available == free_bytes
        print(f"rank {rank}: needs {needed:,} B of {available:,} B free")
        assert record["warnings"][0].startswith(
            f"{owner}: preflight on 2 ranks before step 0: 2 of 2 ranks predicted to run out of memory"
        )


def check_inplace_advice(ranks: list[dict[str, Any]], batch: int, width: int) -> None:
    """Each rank's inplace-activations advice is simulated, saving three of the MLP's four LeakyReLU inputs
    (``batch`` x ``width`` float32 each) that are no longer kept beside their outputs."""
    for rank, record in enumerate(ranks):
        advice = {entry[0]: entry[1:] for entry in record["advice"]}
        basis, saving, detail = advice["inplace-activations"]
        assert basis == "simulated", rank
        assert saving >= 3 * batch * width * 4, (rank, saving)
        assert "nn.LeakyReLU(inplace=True)" in detail
        # each module by its name in the model as built: no wrapper's (FSDP1's `_fsdp_wrapped_module`)
        assert "[1].inplace = True" in detail and "_fsdp_wrapped_module" not in detail, detail
    assert len(ranks) == WORLD_SIZE
