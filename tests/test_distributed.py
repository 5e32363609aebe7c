"""Distributed training on the CPU (gloo): two-process DDP, FSDP2 and DeepSpeed ZeRO runs, and per-rank file names."""

from __future__ import annotations

import csv
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from models import OPTIMIZERS, Classifier, dataset_for, linear_net, loader, trainer
from preloaded_python import run_script

from lightning_vram import VramMonitor
from lightning_vram.records import Phase
from lightning_vram.render.files import report_stem

HANG = 900
"""Seconds a subprocess test may take: ten times what a loaded 2-core machine needs, so only a hang reaches it."""

# Each test starts two processes of its own. `make test` runs pytest-xdist with `--dist loadfile`: this file's tests
# run on one worker, one at a time, so no two of them share the cores (or race for a free port).
pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_process_ddp_reduces_over_ranks(tmp_path: Path, strategy: str) -> None:
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    script = Path(__file__).parent / "ddp_train.py"
    result = run_script(script, str(tmp_path), strategy, timeout=HANG, env=environment)
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
    if strategy == "ddp_spawn":  # the user's monitor, in the process that called fit, holds rank zero's report
        after_fit = json.loads((tmp_path / "after_fit.json").read_text())
        assert after_fit == {"report": report, "report_path": str(log_dir / "vram_report.json")}


def test_a_rank_that_fails_leaves_rank_zero_its_own_report(tmp_path: Path) -> None:
    # Rank 1 raises at train end and its process ends; rank 0's monitor then gathers from a rank that is gone.
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    script = Path(__file__).parent / "ddp_train.py"
    run_script(script, str(tmp_path), "ddp", "peer-fails", timeout=HANG, env=environment)
    assert (tmp_path / "rank1.outcome").read_text() == "RuntimeError: rank 1 fails at train end"
    assert (tmp_path / "rank0.outcome").read_text() == "finished"  # no gloo error reached rank 0's fit
    warned = [text for text in json.loads((tmp_path / "rank0.warnings").read_text()) if "trains on cpu" not in text]
    assert len(warned) == 1 and warned[0].startswith("VramMonitor: the exchange between ranks failed with")
    (log_dir,) = (tmp_path / "ddp").iterdir()
    report = json.loads((log_dir / "vram_report.json").read_text())
    assert [rank["rank"] for rank in report["ranks"]] == [0] and report["ranks"][0]["steps"] == report["steps"] == 4
    assert "the exchange between ranks" in [item["what"] for item in report["not_measured"]]
    assert (tmp_path / "rank0.steps").read_text() == "4"  # the hooks after the monitor's ran


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
    result = run_script(script, str(free_port()), str(tmp_path), timeout=HANG)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        half = counts["full_bytes"] // 2  # every sharded dimension divides by 2
        assert counts["parameters"] == half == counts["local_elements"] * 4
        assert counts["gradients"] == half
        assert counts["optimizer_state"] == 2 * half + 4 * 4  # Adam's moments of the shard, four step counters
        assert counts["model_state"] == [half, half, 2 * half + 16]


def test_fsdp2_gathered_parameters_are_parameters_not_activations(tmp_path: Path) -> None:
    # A GPT-2-class model (tied embedding and lm_head), each block and the root sharded over two gloo ranks: the
    # monitor's counts on step 1, torch's FSDPMemTracker on step 2 (the same shapes), and an unsharded copy (what a
    # DDP rank holds) on the same per-rank batch. FSDP2's root keeps its gathered parameters from forward through
    # backward; the blocks free theirs after their forward.
    pytest.importorskip("transformers")
    script = Path(__file__).parent / "fsdp2_counting.py"
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = run_script(script, str(free_port()), str(tmp_path), timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fsdp2, ddp, tracker = record["fsdp2"], record["ddp"], record["tracker_peak"]
        half = record["full_parameter_bytes"] // 2
        forward, backward, optimizer = (fsdp2["phases"][phase] for phase in ("forward", "backward", "optimizer"))
        # Activations as DDP's, to the byte: the gathered weights autograd saves are parameters.
        assert forward["activations"] == ddp["phases"]["forward"]["activations"]
        assert fsdp2["modules"] == ddp["modules"]  # lm_head lists no tied weight as its saving
        # Each part against torch's own categories.
        assert tracker["_FSDPRefType.SHARDED_PARAM"] == half == optimizer["parameters"]
        gathered = tracker["_FSDPRefType.UNSHARDED_PARAM"]
        assert gathered > 0
        assert forward["parameters"] == backward["parameters"] == half + gathered  # the root's, gathered
        assert tracker["_FSDPRefType.SHARDED_GRAD"] == half == forward["gradients"] == optimizer["gradients"]
        assert tracker["_FSDPRefType.OPT"] == forward["optimizer_state"] == optimizer["optimizer_state"]
        assert abs(tracker["_FSDPRefType.ACT"] - forward["activations"]) <= 0.001 * forward["activations"]


ZERO_STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def zero_counts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each rank's counts for every ZeRO stage, from one pair of processes (one DeepSpeed import and process group)."""
    out = tmp_path_factory.mktemp("zero")
    script = Path(__file__).parent / "zero_accounting.py"
    stages = ",".join(str(stage) for stage in ZERO_STAGES)
    result = run_script(script, stages, str(free_port()), str(out), timeout=HANG)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_deepspeed_zero_counts_this_ranks_partitions(zero_counts: Path, stage: int) -> None:
    for rank in (0, 1):
        counts = json.loads((zero_counts / f"rank{rank}.stage{stage}.json").read_text())
        numel, partition = counts["numel"], counts["partition_numel"]
        assert numel == 100 * 200 + 200 + 200 * 50 + 50
        assert counts["wrapped_optimizer"] == "AdamW"  # DeepSpeed's "Adam" with torch_adam, inside the ZeRO optimizer
        phases = counts["phases"]
        activations = 4 * (100 + 200 + 50) * 4  # batch 4: the input, the ReLU's output, the last Linear's output
        assert phases["forward"][3] == activations
        if stage == 3:  # each rank holds ceil(numel / 2) of every parameter, its gradients and fp32 master copy
            shard = 4 * partition
            state = 3 * shard + 4  # master copy, Adam's two moments, one step counter
            assert counts["after_backward"] == counts["after_step"] == [shard, shard, state]
            assert phases["forward"] == [shard, shard, state, activations]
            assert phases["optimizer"] == [shard, shard, state, 0]
            assert phases["backward"][1] > shard  # plus the reduction bucket gradients pass through
        else:  # whole parameters (padded to a multiple of 2 x world size elements); state of this rank's half
            parameters = counts["after_step"][0]
            assert 4 * numel <= parameters <= 4 * (numel + 2 * 2)
            state = 3 * (parameters // 2) + 4
            assert counts["after_step"] == [parameters, 0, state]  # ZeRO-1/2 free the gradients at the step
            assert 4 * partition <= counts["after_backward"][1] <= parameters
            assert phases["forward"] == [parameters, 0, state, activations]
            assert phases["optimizer"] == [parameters, counts["after_backward"][1], state, 0]
            if stage == 1:  # ZeRO-1 keeps whole gradients through backward
                assert phases["backward"][1] == 4 * numel
            else:  # ZeRO-2 copies them into its reduction bucket
                assert phases["backward"][1] > 4 * numel


def single_process_activations(root: Path, batch_size: int) -> int:
    """Forward activations of the DeepSpeed script's model and batch, trained the plain way."""
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    model = Classifier(linear_net(), OPTIMIZERS["adam"])
    trainer(root, [monitor], max_steps=2).fit(model, loader(dataset_for("linear"), batch_size=batch_size))
    assert monitor.report is not None
    forward = monitor.report.phases[Phase.FORWARD].breakdown
    assert forward is not None
    return forward.activations


def run_sharded(out: Path, strategy: str, *extra: str) -> list[dict[str, Any]]:
    """Train with ``strategy`` on two CPU processes (tests/sharded_train.py, ``extra`` its further arguments); each
    rank's record."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = Path(__file__).parent / "sharded_train.py"
    result = run_script(script, str(out), strategy, *extra, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["ranks"] == 2 and record["steps"] == 4
    return records


def test_lightning_fsdp2_reports_this_ranks_shards(tmp_path: Path) -> None:
    activations = single_process_activations(tmp_path / "plain", batch_size=16)
    shard = (160 + 5) * 4  # Linear(32, 10) sharded on dim 0: 5 of the weight's 10 rows, 5 of the bias's 10 values
    state = 2 * shard + 2 * 4  # Adam's two moments of the shard, a step counter for each of the two parameters
    gathered = (320 + 10) * 4  # the whole Linear, all-gathered for its forward and again for its backward
    saved_input = 16 * 32 * 4  # what the Linear saves; the loss saves the rest of the activations after it
    assert activations > saved_input
    for record in run_sharded(tmp_path, "fsdp2"):
        phases = record["phases"]
        # The highest moment of forward is inside the Linear, its weight gathered (a parameter, not an activation);
        # the loss's saved tensors come after FSDP2 freed it. The previous step's gradients are still held.
        assert phases["forward"] == [shard + gathered, shard, state, saved_input]
        assert phases["optimizer"] == [shard, shard, state, 0]
        # FSDP2 sets the sharded gradients after reduce-scatter, when the activations are already freed; the
        # Linear's backward gathers its weight again after the loss's backward freed what the loss saved.
        assert phases["backward"] == [shard + gathered, 0, state, saved_input]


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_reports_this_ranks_partitions(tmp_path: Path, stage: int) -> None:
    activations = single_process_activations(tmp_path / "plain", batch_size=16)
    bucket = 1000 * 4  # reduce_bucket_size elements of float32, the buffer gradients are reduced through
    for record in run_sharded(tmp_path, f"deepspeed_stage_{stage}"):
        phases = record["phases"]
        if stage == 3:  # Linear(32, 10): each rank holds 160 of the weight's 320 elements and 5 of the bias's 10
            shard = (160 + 5) * 4
            state = 3 * shard + 4  # the fp32 master copy, Adam's two moments, one step counter
            assert phases["forward"] == [shard, shard, state, activations]  # gathered weights are not activations
            assert phases["backward"] == [shard, shard + bucket, state, 0]
            assert phases["optimizer"] == [shard, shard, state, 0]
        else:  # whole parameters, padded to 332 elements; the state of this rank's 166
            whole = 332 * 4
            state = 3 * 166 * 4 + 4
            assert phases["forward"] == [whole, 0, state, activations]
            assert phases["backward"] == [whole, bucket, state, 0]
            assert phases["optimizer"][::2] == [whole, state]
            assert 166 * 4 <= phases["optimizer"][1] <= whole  # the storages under this rank's gradient partition
