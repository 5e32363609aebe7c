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
from measured_again import measured_again_where_missed
from preloaded_python import run_script
from test_distributed import HANG, free_port

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
REPLAYED = "fsdp2 x2: replayed: torch's fully_shard under a fake process group"
CPU = "VramMonitor: the model trains on cpu, not a CUDA GPU"
"""The one warning a CPU run gives (the monitor's own, at the start)."""
SESSION_CPU = CPU.replace("VramMonitor", "VramSession", 1)
"""The same warning where the plain loop's VramSession measures: it names the object the user made."""


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
    # Now and then (2 runs of 6 at 727d918, 2 of 26 since, on an idle machine; once in a fresh-clone run) a
    # rank's optimizer live peak measures 4,232 bytes over its replay (37,796 for 33,564) and the rank refuses it:
    # the size of the first unit's reduce-scatter input (1,056 fp32 elements, 4,224 bytes) and 8 more, still
    # allocated when the optimizer steps. Not found why: the live count said nothing was released late by another
    # thread. Measured once more where a rank was skipped; every run trains as without the monitor.
    runs: list[list[dict[str, Any]]] = []

    def measure(out: Path) -> list[dict[str, Any]]:
        out.mkdir(exist_ok=True)
        runs.append(compare("reads", out))
        return runs[-1]

    def skipped(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
        return [(rank, record["skipped"]) for rank, record in enumerate(records) if record["skipped"] is not None]

    assert measured_again_where_missed(tmp_path / "monitored", measure, skipped, lambda miss: miss[0]) == []
    for record in runs[-1]:
        assert record["skipped"] is None and record["note"] == REPLAYED
    for record in (record for records in runs for record in records):
        assert len(record["groups"]) == 2
        assert record["seen"][0] == "('data_parallel', 'tensor_parallel') 2 (16, 32)"  # the first layer's shard


def test_a_step_turning_gradient_sync_off_by_batch_index_is_replayed_and_trains_the_same(tmp_path: Path) -> None:
    # accumulate_grad_batches=2, the step calling set_requires_gradient_sync(batch_idx % 2 == 1): the sampled
    # micro-batch (2) reduces nothing and holds no sharded gradient. The replay gave every micro-batch batch_idx 0, so
    # its window never synced ("backward gradients replayed 5544 bytes, measured 0"); each replayed micro-batch now
    # gets the index of its place in the window, and the rank's baseline matches (within 5%: it is not skipped).
    for record in compare("accumulate", tmp_path):
        assert record["skipped"] is None and record["note"] == REPLAYED


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
    # The MLP has one hidden layer: ZeRO-3 holds each layer's parameters gathered whole from its forward to its
    # backward (stage3_max_reuse_distance), and in forward one all-gather's flat buffer too. The per-rank model once
    # counted none of it (backward replayed 356,328 bytes, measured 414,396: skipped); each rank is replayed, every
    # part and live peak within 5% of its sampled step. A rank's gloo thread now and then holds a collective's
    # tensors at a peak: measured once more where a rank was skipped.
    zero3 = "zero3_hostile_train.py"
    bare = run(tmp_path / "bare", "plain", "no-monitor", script=zero3)
    runs: list[list[dict[str, Any]]] = []

    def measure(out: Path) -> list[dict[str, Any]]:
        out.mkdir(exist_ok=True)
        runs.append(run(out / "run", "plain", script=zero3))
        return runs[-1]

    def skipped(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
        return [(rank, record["skipped"]) for rank, record in enumerate(records) if record["skipped"] is not None]

    assert measured_again_where_missed(tmp_path / "monitored", measure, skipped, lambda miss: miss[0]) == []
    failing = run(tmp_path / "failing", "partition", script=zero3)
    for rank in range(WORLD_SIZE):
        assert bare[rank]["skipped"] is None and bare[rank]["warnings"] == []
        assert all(trained(records[rank]) == trained(bare[rank]) for records in runs), rank
        assert trained(failing[rank]) == trained(bare[rank]), rank
        assert bare[rank]["calls"] == {"forward hook": 2, "backward hook": 2} and len(bare[rank]["groups"]) == 2
        reason = failing[rank]["skipped"]  # where the step read it: the user's line, not the replay's
        assert reason.startswith("the step failed under fake tensors at ") and "zero3_hostile_train.py:" in reason
        assert reason.endswith("(loss_of): AttributeError: 'FakeTensor' object has no attribute 'ds_numel'"), reason
        for record in (*(records[rank] for records in runs), failing[rank]):
            assert len(record["warnings"]) == 1 and record["warnings"][0].startswith(SESSION_CPU)
