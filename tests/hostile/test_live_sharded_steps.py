"""A live FSDP2 or ZeRO-3 rank's step that reads and talks to its sharded run, replayed: training unchanged.

Two gloo ranks under Lightning's ``ModelParallelStrategy`` (tests/hostile/fsdp2_hostile_train.py), and under
DeepSpeed's ZeRO-3 in a plain loop (tests/hostile/zero3_hostile_train.py), train with and without the monitor.
Found by attacking the live FSDP2 replay: a step calling ``full_tensor()`` on a parameter was skipped as "the step
runs a collective (_c10d_functional.wait_tensor.default)": the replay let the copy's all-gather over its fake group
through, then refused the wait that follows it, which names no group and issues nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from preloaded_python import run_script
from test_distributed import HANG, free_port

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
REPLAYED = "fsdp2 x2: replayed: torch's fully_shard under a fake process group"
CPU = "VramMonitor: the model trains on cpu, not a CUDA GPU"
"""The one warning a CPU run gives (the monitor's own, at the start)."""


def run(out: Path, case: str, *mode: str, script: str = "fsdp2_hostile_train.py") -> list[dict[str, Any]]:
    """Each rank's record of the hostile run ``case`` of ``script`` made in ``out``."""
    out.mkdir()
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    where = [str(free_port())] if script.startswith("zero3") else []
    result = run_script(Path(__file__).parent / script, *where, str(out), case, *mode, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"run{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


def trained(record: dict[str, Any]) -> dict[str, Any]:
    """What the rank trained and left: all but the monitor's own findings."""
    return {key: value for key, value in record.items() if key not in ("skipped", "note", "warnings")}


def compare(case: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's monitored record, after checking it trained as without the monitor."""
    monitored, bare = run(tmp_path / "monitored", case), run(tmp_path / "bare", case, "no-monitor")
    for rank in range(WORLD_SIZE):
        assert trained(monitored[rank]) == trained(bare[rank]), rank
        assert bare[rank]["warnings"] == [] and bare[rank]["skipped"] is None
        assert len(monitored[rank]["warnings"]) == 1 and monitored[rank]["warnings"][0].startswith(CPU)
        record = monitored[rank]
        # 4 steps (no replay counted), each hook once a step, the run's own groups only (the default and the
        # mesh's), 4 losses.
        assert record["steps"] == 4 and record["calls"] == {"forward hook": 4, "backward hook": 4}
        assert record["group ranks"] == len(record["groups"]) + 1 and len(record["losses"]) == 4
    return monitored


def test_a_step_reading_its_sharded_run_s_objects_is_replayed_and_trains_the_same(tmp_path: Path) -> None:
    # The module's mesh, a parameter's full_tensor() and to_local(), a DTensor attribute, get_rank(), dropout, a
    # generator of the user's, counting hooks; units with reshard_after_forward=False and in bfloat16.
    for record in compare("reads", tmp_path):
        assert record["skipped"] is None and record["note"] == REPLAYED and len(record["groups"]) == 2
        assert record["seen"][0] == "('data_parallel', 'tensor_parallel') 2 (16, 32)"  # the first layer's shard


def test_a_step_running_collectives_on_its_run_s_group_is_skipped_and_trains_the_same(tmp_path: Path) -> None:
    # An all-reduce of a metric over the module's mesh (the copy's, over fake groups, in a replay), a barrier on a
    # group of the run's ranks the step makes, self.all_gather: each rank's replay stops at the new group, before it
    # is made (its ranks would have to meet; a group made left behind shifts the names of the run's later groups);
    # training's collectives and groups pair up as without the monitor.
    for record in compare("collectives", tmp_path):
        assert record["skipped"].startswith("the step makes a process group (torch.distributed.new_group)")
        assert len(record["groups"]) == 6  # the default group, the mesh's, the 4 steps' own
        assert record["note"] is None


def test_a_zero3_step_with_the_user_s_hooks_rng_and_rank_branch_is_replayed_and_trains_the_same(
    tmp_path: Path,
) -> None:
    # Dropout, a generator of the user's, get_rank() to branch, counting hooks: each rank's replay runs; a step
    # reading ZeRO-3's ds_numel fails in the replay (its copy's parameters are whole, plain) and is skipped saying
    # so, without a warning of its own. Both train as the plain step without the monitor (ds_numel > 0 multiplies
    # by one).
    zero3 = "zero3_hostile_train.py"
    bare = run(tmp_path / "bare", "plain", "no-monitor", script=zero3)
    monitored = run(tmp_path / "monitored", "plain", script=zero3)
    failing = run(tmp_path / "failing", "partition", script=zero3)
    for rank in range(WORLD_SIZE):
        assert bare[rank]["skipped"] is None and bare[rank]["warnings"] == []
        assert trained(monitored[rank]) == trained(failing[rank]) == trained(bare[rank]), rank
        assert bare[rank]["calls"] == {"forward hook": 2, "backward hook": 2} and len(bare[rank]["groups"]) == 2
        assert monitored[rank]["skipped"] is None
        assert failing[rank]["skipped"] == (
            "the step failed under fake tensors: AttributeError: 'FakeTensor' object has no attribute 'ds_numel'"
        )
        for record in (monitored[rank], failing[rank]):
            assert len(record["warnings"]) == 1 and record["warnings"][0].startswith(CPU)
