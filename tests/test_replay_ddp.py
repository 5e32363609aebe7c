"""DDP replayed per rank, in one process: what DDP holds beyond the step, and no collective inside a replay.

The multi-process ground truth (each rank's replay against its own measured step, at world sizes 2 and 4) is in
tests/test_distributed_replay.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram.advice.trials import unsupported
from lightning_vram.measure.ddp import live_buckets, predicted_buckets, replay_refusal
from lightning_vram.measure.live import LiveTensors
from lightning_vram.measure.setup import training_setup
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.step import lightning_training_step
from lightning_vram.records import Phase, ReplayedStep, ReplaySkipped, Simulation, StrategyBuffers
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict

# The replay of the step under fake tensors.
pytestmark = pytest.mark.replay

FLOAT32 = 4
BATCH = (torch.randn(8, 32), torch.randint(0, 10, (8,)))


def test_the_strategy_s_buffers_are_in_every_phase_and_in_other() -> None:
    module = Classifier(nn.Linear(32, 10), OPTIMIZERS["sgd"])
    plain = Predictor(module, None, BATCH, warm_up=True).baseline()
    buffers = StrategyBuffers("DDP gradient buckets", (1000, 24), "by hand")
    held = Predictor(module, None, BATCH, warm_up=True, strategy=buffers).baseline()
    assert isinstance(plain, ReplayedStep) and isinstance(held, ReplayedStep)
    assert held.strategy == buffers and plain.strategy is None
    assert held.phases.keys() == plain.phases.keys() == set(Phase)
    for phase, peak in held.phases.items():
        before, after = plain.phases[phase].breakdown, peak.breakdown
        assert before is not None and after is not None and before.other is not None and after.other is not None
        assert peak.peak_bytes == plain.phases[phase].peak_bytes + 1024
        assert after.other == before.other + 1024
        assert after.counted_bytes == before.counted_bytes


def test_the_strategy_line_reads_back_from_the_report_json() -> None:
    module = Classifier(nn.Linear(32, 10), OPTIMIZERS["sgd"])
    buffers = StrategyBuffers("DDP gradient buckets", (1000, 24), "by hand")
    simulation = Predictor(module, None, BATCH, warm_up=True, strategy=buffers).simulate()
    data = json.loads(json.dumps(simulation_to_dict(simulation)))
    assert data["strategy"] == {
        "label": "DDP gradient buckets",
        "bytes": 1024,
        "buffers": [1000, 24],
        "basis": "by hand",
    }
    back = simulation_from_dict(data)
    assert isinstance(back, Simulation) and back.baseline is not None and back.baseline.strategy == buffers
    del data["strategy"]  # a report written before the field existed
    older = simulation_from_dict(data)
    assert older is not None and older.baseline is not None and older.baseline.strategy is None


class AllReducesItsLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        dist.all_reduce(loss)  # a collective inside the step
        return loss


def test_a_collective_in_the_step_stops_the_replay(gloo_one_rank: None) -> None:
    # Each rank replays on its own: a collective there would wait for ranks whose replays never reach it.
    module = AllReducesItsLoss(nn.Linear(32, 10), OPTIMIZERS["sgd"])
    result = Predictor(module, None, BATCH, warm_up=True).baseline()
    assert isinstance(result, ReplaySkipped)
    assert result.reason.startswith("the step runs a collective (c10d.allreduce_.default): a rank's replay runs none")


def test_ddp_buckets_hold_a_second_copy_of_every_gradient(gloo_one_rank: None) -> None:
    # Three Linears. In reverse order the head and the second Linear pass 1 MiB and close the first bucket; the
    # first Linear opens the second (of at most 25 MiB).
    network = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 10))
    ddp = nn.parallel.DistributedDataParallel(network)
    linear, head = (512 * 512 + 512) * FLOAT32, (512 * 10 + 10) * FLOAT32
    buckets = predicted_buckets(ddp)
    assert buckets.label == "DDP gradient buckets" and "gradient_as_bucket_view=False" in buckets.basis
    assert buckets.buffers == (head + linear, linear)
    assert live_buckets(ddp) == (head + 2 * linear,)  # before its first forward DDP keeps one bucket for all
    for _ in range(2):
        ddp(torch.randn(4, 512)).sum().backward()
        # After one backward DDP rebuilds its buckets at the next forward: none held before that forward.
        assert live_buckets(ddp) == (() if _ == 0 else buckets.buffers)
    # torch's own count of the Reducer's buckets, once rebuilt.
    assert [bucket.buffer().nbytes for bucket in ddp.reducer._get_zeros_like_grad_buckets()] == list(buckets.buffers)


def test_ddp_with_gradients_as_bucket_views_is_not_replayed_with_buckets(gloo_one_rank: None) -> None:
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 2), gradient_as_bucket_view=True)
    reason = replay_refusal(ddp)
    assert reason is not None and reason.startswith("DDP with gradient_as_bucket_view=True")
    assert live_buckets(ddp) == ()  # the gradients are the buckets: counted as gradients


def test_the_live_count_holds_storages_no_tensor_reaches_and_counts_them_once() -> None:
    # A bucket alive before the step, reached by no registered tensor: held from the start; the op that writes into
    # it (as DDP's Reducer copies a gradient into its slot) does not count it again. A new tensor of the same size
    # is new memory.
    bucket = torch.empty(256)  # 1 KiB
    live = LiveTensors(torch.device("cpu"))
    live.hold([bucket.untyped_storage().nbytes()])
    live.start()
    try:
        assert live.live_bytes == 1024
        torch.mul(torch.ones(256), 0.5, out=bucket)
        assert live.live_bytes == 1024  # the ones are freed already; the bucket counted once
        fresh = torch.ones(256) * 2
        assert live.live_bytes == 2048
        live.close_segment(Phase.FORWARD)
    finally:
        live.stop()
    del fresh
    assert live.phase_peaks[Phase.FORWARD] == 1024 + 1024 + 1024  # bucket, the ones beside the product, the product


class DoublesOnRankOne(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        if self.global_rank == 1:
            inputs, targets = inputs.repeat(2, 1), targets.repeat(2)
        return super().training_step((inputs, targets), batch_idx)


class ReadsTheStrategy(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.trainer.strategy is not None
        return super().training_step(batch, batch_idx)


def trained_by(module: Classifier, world_size: int, rank: int) -> Classifier:
    """``module`` as a Trainer of ``world_size`` processes holds it on ``rank`` (its ranks and counters only)."""
    module._trainer = SimpleNamespace(  # type: ignore[assignment]
        world_size=world_size, global_rank=rank, local_rank=rank, node_rank=0, global_step=3, current_epoch=0
    )
    return module


def test_each_rank_s_replay_runs_its_own_rank_s_step() -> None:
    # The replay's copy drops the Trainer; under several processes it keeps the rank, so rank 1 replays rank 1's step.
    activations = {}
    for rank in (0, 1):
        module = trained_by(DoublesOnRankOne(nn.Linear(32, 10), OPTIMIZERS["sgd"]), 2, rank)
        result = Predictor(module, None, BATCH, warm_up=True).baseline()
        assert isinstance(result, ReplayedStep)
        breakdown = result.phases[Phase.FORWARD].breakdown
        assert breakdown is not None
        activations[rank] = breakdown.activations
    # The Linear's input, cross-entropy's log-probabilities, its int64 targets and nll_loss's float32 total weight.
    assert activations == {rank: n * 32 * FLOAT32 + n * 10 * FLOAT32 + n * 8 + FLOAT32 for rank, n in ((0, 8), (1, 16))}
    one_process = trained_by(DoublesOnRankOne(nn.Linear(32, 10), OPTIMIZERS["sgd"]), 1, 0)
    assert isinstance(Predictor(one_process, None, BATCH, warm_up=True).baseline(), ReplayedStep)
    skipped = Predictor(trained_by(ReadsTheStrategy(nn.Linear(32, 10)), 2, 1), None, BATCH, warm_up=True).baseline()
    assert isinstance(skipped, ReplaySkipped) and skipped.reason.startswith("the step reads self.trainer")


@pytest.mark.parametrize(
    ("strategy", "world_size", "accumulate", "automatic", "reason"),
    [
        ("DDPStrategy", 2, 1, True, None),  # replayed per rank
        ("DDPStrategy", 2, 2, True, None),  # gradient accumulation: replayed per rank too
        ("DDPStrategy", 2, 1, False, None),  # manual optimization: replayed per rank too
        ("FSDPStrategy", 2, 1, True, "FSDPStrategy: sharded steps need the other ranks' collectives"),
        ("DeepSpeedStrategy", 2, 1, True, "DeepSpeedStrategy: sharded steps need the other ranks' collectives"),
        ("ModelParallelStrategy", 2, 1, True, "ModelParallelStrategy: sharded steps need the other ranks'"),
        ("SomeOtherStrategy", 2, 1, True, "distributed training: the replay runs one process"),
    ],
)
def test_only_ddp_is_replayed_per_rank_the_rest_keeps_its_reason(
    strategy: str, world_size: int, accumulate: int, automatic: bool, reason: str | None
) -> None:
    module = Classifier(nn.Linear(8, 2))
    setup = training_setup(
        module,
        [module.configure_optimizers()],
        world_size=world_size,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        automatic_optimization=automatic,
    )
    found = unsupported(module, setup, lightning_training_step)
    assert found == reason if reason is None else (found is not None and found.startswith(reason))
