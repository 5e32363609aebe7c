"""One rank of a multi-GPU strategy predicted from one process (``predict_rank``), at world sizes 1 to 1,024.

The multi-process ground truth (each gloo rank's measured step against the one-process prediction for its world
size) is in tests/test_rank_prediction_distributed.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram.measure.ddp import bucket_sizes, reduced_parameters
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import PREDICTORS, predict_rank
from lightning_vram.records import Phase, RankStep, ReplayedStep, ReplaySkipped, StrategySpec

FLOAT32 = 4
BATCH = (torch.randn(8, 512), torch.randint(0, 10, (8,)))


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


LINEAR, HEAD = (512 * 512 + 512) * FLOAT32, (512 * 10 + 10) * FLOAT32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "zero"}, "name must be one of single, ddp, fsdp2, fsdp, deepspeed_stage_1"),
        ({"name": "ddp", "world_size": 0}, "world_size must be from 1 to 1024; got 0"),
        ({"name": "ddp", "world_size": 1025}, "world_size must be from 1 to 1024; got 1025"),
        ({"name": "ddp", "world_size": 2.0}, "world_size must be an int from 1 to 1024; got 2.0"),
        ({"name": "single", "world_size": 2}, "world_size must be 1 for the single-device strategy; got 2"),
        ({"name": "ddp", "sharding": "FULL_SHARD"}, "sharding must be None for ddp; got 'FULL_SHARD'"),
        ({"name": "fsdp2", "sharding": "NO_SHARD"}, "sharding must be one of FULL_SHARD, SHARD_GRAD_OP or None"),
        ({"name": "ddp", "offload": True}, "offload must be False for ddp (it has no CPU offload); got True"),
        ({"name": "fsdp", "world_size": 4, "gpus_per_node": 8}, "gpus_per_node must be None or an int from 1 to"),
    ],
)
def test_a_bad_spec_fails_at_construction_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StrategySpec(**fields)  # type: ignore[arg-type]


def test_a_spec_s_label_names_each_setting() -> None:
    assert StrategySpec("fsdp2", 8, "FULL_SHARD").label == "fsdp2 x8 FULL_SHARD"
    assert StrategySpec("ddp", 4).label == "ddp x4"
    assert StrategySpec("single").label == "single"
    assert StrategySpec("fsdp", 16, "HYBRID_SHARD", True, 8).label == "fsdp x16 HYBRID_SHARD offload (8 per node)"


def test_a_strategy_not_registered_is_skipped_saying_so() -> None:
    predictor = Predictor(Classifier(network(), OPTIMIZERS["sgd"]), None, BATCH, warm_up=True)
    names = {"deepspeed_stage_3", "fsdp"} - set(PREDICTORS)
    for name in names:
        assert predict_rank(predictor, StrategySpec(name, 2)) == ReplaySkipped(f"{name}: not modelled yet")


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank (this process), destroyed after the test.

    Not torch's fake group: DDP's backward fails there (its all-reduce's future holds no tensor: "expected the hook
    result is either a Tensor or a TensorList found None", c10d/comm.cpp).
    """
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cap_mb", [None, 1])
def test_the_buckets_from_the_parameters_are_the_reducer_s(one_rank: None, cap_mb: int | None) -> None:
    # torch's own DDP at world size 1 builds its Reducer (and holds the buckets): after the rebuild at its second
    # forward, its buckets are the arithmetic's, worked out without a DDP.
    module = network()
    ddp = nn.parallel.DistributedDataParallel(module, **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    for _ in range(2):
        ddp(BATCH[0]).sum().backward()
    reducer = tuple(bucket.buffer().untyped_storage().nbytes() for bucket in ddp.reducer._get_zeros_like_grad_buckets())
    cap = 25 * 1024 * 1024 if cap_mb is None else cap_mb * 1024 * 1024
    assert bucket_sizes(reduced_parameters(module), cap).buffers == reducer
    assert sum(reducer) == 2 * LINEAR + HEAD


@pytest.mark.replay
def test_a_ddp_rank_is_the_replay_holding_the_buckets_at_any_world_size() -> None:
    module = Classifier(network(), OPTIMIZERS["adam"])
    predictor = Predictor(module, None, BATCH, warm_up=True)
    single = predict_rank(predictor, StrategySpec("single"))
    assert isinstance(single, RankStep) and isinstance(single.replayed, ReplayedStep)
    assert single.lines == () and single.communication_bytes == 0
    gradients = 2 * LINEAR + HEAD
    for world_size in (1, 2, 8, 1024):
        rank = predict_rank(predictor, StrategySpec("ddp", world_size))
        assert isinstance(rank, RankStep), rank
        assert rank.method.startswith("arithmetic on the single-process replay: DDP's Reducer")
        (buckets,) = rank.lines  # no NCCL line on the CPU
        assert (buckets.label, buckets.bytes, buckets.on_host) == ("DDP gradient buckets (2)", gradients, False)
        assert rank.communication_bytes == 2 * (world_size - 1) * gradients // world_size
        for phase in Phase:
            alone, held = single.phases[phase], rank.phases[phase]
            assert held.peak_bytes == alone.peak_bytes + gradients  # the buckets, in every phase
            assert held.breakdown is not None and alone.breakdown is not None
            assert held.breakdown.counted_bytes == alone.breakdown.counted_bytes
        assert rank.peak.peak_bytes == single.peak.peak_bytes + gradients
    assert predictor.strategy is None  # the round's own predictor holds no buckets afterwards
