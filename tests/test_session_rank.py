"""A plain loop's session on gloo ranks started without ``rank`` takes the process group's rank and world size.

A plain loop on rank 1 of a DeepSpeed ZeRO-2 run (2 gloo ranks, a transformer LM), its ``VramSession.start`` given
no ``rank`` as the README's plain loop shows it, was replayed as rank 0: "the replay does not reproduce sampled step
2: optimizer gradients replayed 1238528 bytes, measured 1045920" (rank 0's gradients crossing its partition's edges),
so the rank got no simulated advice. Before, ``rank`` was 0 and ``world_size`` 1 unless given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from preloaded_python import run_script
from test_distributed import HANG, free_port

from lightning_vram import VramSession

pytestmark = pytest.mark.distributed


def test_each_rank_takes_the_process_groups_rank_and_world_size(tmp_path: Path) -> None:
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = Path(__file__).parent / "session_rank_train.py"
    result = run_script(script, str(free_port()), str(tmp_path), timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {"rank": rank, "world_size": 2, "ranks": [rank]}


def test_without_a_process_group_a_session_is_rank_0_of_1() -> None:
    session = VramSession(console_summary=False, replay_budget_seconds=0.0, preflight=False)
    session.start(torch.nn.Linear(2, 2), [], device=torch.device("cpu"))
    assert (session._context.rank, session._context.world_size) == (0, 1)
    session.close()
