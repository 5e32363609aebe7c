"""One rank of a multi-GPU strategy predicted from one process (``predict_rank``), at world sizes 1 to 1,024.

The multi-process ground truth (each gloo rank's measured step against the one-process prediction for its world
size) is in tests/test_rank_prediction_distributed.py.
"""

from __future__ import annotations

import sys
from types import FrameType

import pytest
import torch
import torch.distributed as dist
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram.measure.ddp import bucket_sizes, reduced_parameters
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.prediction.strategies import PREDICTORS, predict_rank
from lightning_vram.prediction.strategies.fsdp2 import RankChunks
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


def test_a_strategy_not_registered_is_skipped_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every strategy name is registered today: take one out, as a name added to the spec before its model would be.
    monkeypatch.delitem(PREDICTORS, "deepspeed_stage_3")
    predictor = Predictor(Classifier(network(), OPTIMIZERS["sgd"]), None, BATCH, warm_up=True)
    assert predict_rank(predictor, StrategySpec("deepspeed_stage_3", 2)) == ReplaySkipped(
        "deepspeed_stage_3: not modelled yet"
    )


@pytest.mark.parametrize("cap_mb", [None, 1])
def test_the_buckets_from_the_parameters_are_the_reducer_s(gloo_one_rank: None, cap_mb: int | None) -> None:
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


@pytest.mark.replay
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_ddp_rank_from_the_single_replay_is_the_replay_holding_the_buckets(precision: str) -> None:
    """The single-process replay plus the buckets' arithmetic gives what a second replay holding them gave."""
    module = Classifier(network(), OPTIMIZERS["adam"])
    predictor = Predictor(module, None, BATCH, precision=precision, warm_up=True, allocator=AllocatorSettings())
    rank = predict_rank(predictor, StrategySpec("ddp", 4))
    assert isinstance(rank, RankStep) and rank.replayed is not None
    dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    buckets = bucket_sizes(reduced_parameters(module), dtype=dtype)
    second = predictor.sharing_walk()
    second.strategy = buckets
    replayed = second.replay()
    assert isinstance(replayed, ReplayedStep)
    assert rank.phases == replayed.phases  # peaks, reserved peaks and breakdowns, to the byte
    assert all(peak.reserved_bytes for peak in rank.phases.values())
    assert rank.replayed.strategy == replayed.strategy == buckets
    assert rank.replayed.allocations is not None and replayed.allocations is not None
    unbounded = serve(replayed.allocations, AllocatorSettings(), 2**40).reserved_peak_bytes
    assert serve(rank.replayed.allocations, AllocatorSettings(), 2**40).reserved_peak_bytes == unbounded
    for capacity in range(unbounded - 8 * 2**20, unbounded + 2**20, 2**20):  # where it fits, and where it does not
        derived = serve(rank.replayed.allocations, AllocatorSettings(), capacity)
        again = serve(replayed.allocations, AllocatorSettings(), capacity)
        assert derived.served == again.served, capacity
        assert derived.served or derived.shortfall.phase == again.shortfall.phase  # type: ignore[union-attr]
    alone = predictor.replay()
    assert isinstance(alone, ReplayedStep) and alone.timeline is not None
    assert rank.replayed.timeline is not None and replayed.timeline is not None
    points = list(zip(alone.timeline.points, rank.replayed.timeline.points, replayed.timeline.points, strict=True))
    # The timeline's other is clamped at 0 where the counted parts exceed the live bytes (gradients let go of and
    # still counted): only there may the derived point be above the replayed one.
    assert [derived for single, derived, _ in points if single.other > 0] == [
        again for single, _, again in points if single.other > 0
    ]
    assert sum(single.other > 0 for single, _, _ in points) > len(points) // 2


class ShardedMlp(Classifier):
    """Three Linears, each its own FSDP2 unit under ModelParallelStrategy's mesh, then the network."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.network:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.network, mesh=mesh)


def padded(rows: int, columns: int, world_size: int) -> int:
    """One rank's shard of a (rows, columns) float32 parameter, dim 0 padded to the world size (bytes)."""
    return -(-rows // world_size) * columns * FLOAT32


@pytest.mark.replay
@pytest.mark.parametrize("world_size", [1, 2, 8, 1024])
def test_an_fsdp2_rank_holds_its_shards_at_any_world_size(world_size: int) -> None:
    # torch's fully_shard on the replay's copy, under a fake group of world_size ranks, in this one process.
    predictor = Predictor(ShardedMlp(network(), OPTIMIZERS["adam"]), None, BATCH)
    rank = predict_rank(predictor, StrategySpec("fsdp2", world_size))
    assert isinstance(rank, RankStep), rank
    assert rank.method == "replayed: torch's fully_shard under a fake process group"
    shard = 2 * (padded(512, 512, world_size) + padded(512, 1, world_size))
    shard += padded(10, 512, world_size) + padded(10, 1, world_size)
    optimizer = rank.phases[Phase.OPTIMIZER].breakdown
    assert optimizer is not None
    assert optimizer.parameters == optimizer.gradients == shard  # this rank's shards, padded
    assert optimizer.optimizer_state == 2 * shard + 6 * FLOAT32  # Adam's two moments and a step per parameter
    # Forward's peak holds the shards and one unit gathered whole (padded): a 512x512 Linear at most.
    forward = rank.phases[Phase.FORWARD].breakdown
    assert (
        forward is not None and shard < forward.parameters <= shard + (padded(512, 512, world_size) + 2048) * world_size
    )
    gather, scatter = rank.lines
    assert (
        gather.label
        == "FSDP2 all-gather buffer (largest unit: network.0)"
        == scatter.label.replace("reduce-scatter", "all-gather")
    )
    assert gather.bytes == (padded(512, 512, world_size) + padded(512, 1, world_size)) * world_size
    assert not dist.is_initialized()  # the fake group is gone


@pytest.mark.replay
def test_fsdp2_s_sent_bytes_and_the_single_rank_s_are_the_arithmetic() -> None:
    predictor = Predictor(ShardedMlp(network(), OPTIMIZERS["adam"]), None, BATCH)
    alone = predict_rank(predictor, StrategySpec("fsdp2", 1))
    four = predict_rank(predictor, StrategySpec("fsdp2", 4))
    kept = predict_rank(predictor, StrategySpec("fsdp2", 4, "SHARD_GRAD_OP"))
    assert isinstance(alone, RankStep) and isinstance(four, RankStep) and isinstance(kept, RankStep)
    assert alone.communication_bytes == 0
    linear = LINEAR  # 512 rows divide by 4; the head's 10 rows are padded to 12
    head = 4 * (padded(10, 512, 4) + padded(10, 1, 4))
    # Each Linear gathered for forward and again for backward (resharded after forward), its gradients
    # reduce-scattered; the root holds no parameter of its own.
    assert four.communication_bytes == 3 * 3 * (2 * linear + head) // 4
    assert kept.communication_bytes == 2 * 3 * (2 * linear + head) // 4
    # SHARD_GRAD_OP keeps the gathered Linears after forward: backward's peak holds more parameters.
    full, grad_op = four.phases[Phase.BACKWARD].breakdown, kept.phases[Phase.BACKWARD].breakdown
    assert full is not None and grad_op is not None and grad_op.parameters > full.parameters


def test_fsdp2_leaves_a_process_group_of_the_user_s_alone(gloo_one_rank: None) -> None:
    predictor = Predictor(ShardedMlp(network(), OPTIMIZERS["adam"]), None, BATCH)
    group = dist.group.WORLD
    assert predict_rank(predictor, StrategySpec("fsdp2", 8)) == ReplaySkipped(
        "fsdp2: a process group is initialized in this process; the replay's fake group cannot replace it"
    )
    assert dist.group.WORLD is group and dist.get_backend() == "gloo" and dist.get_world_size() == 1


@pytest.mark.parametrize(("rows", "count"), [(10, 4), (10, 1024), (512, 8), (3, 3), (0, 4)])
def test_fsdp2_s_lazy_chunks_are_torch_s_chunks_padded_with_empty_ones(rows: int, count: int) -> None:
    tensor = torch.arange(rows * 3.0).reshape(rows, 3)
    expected = list(torch.chunk(tensor, count, dim=0)) if rows else []
    expected += [tensor.new_empty(0)] * (count - len(expected))
    lazy = RankChunks(tensor, count, 0)
    assert len(lazy) == count
    for index, chunk in enumerate(expected):
        got = lazy[index]
        assert (got.shape, got.storage_offset(), got.stride() if got.numel() else ()) == (
            chunk.shape,
            chunk.storage_offset(),
            chunk.stride() if chunk.numel() else (),
        )
        assert torch.equal(got, chunk)
    assert lazy[-1].shape == expected[-1].shape
    with pytest.raises(IndexError):
        lazy[count]


class ShardedAllReducing(ShardedMlp):
    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        dist.all_reduce(loss.detach().clone())  # a collective inside the step: under the fake group it sends nothing
        return loss


@pytest.mark.replay
def test_a_collective_in_the_step_runs_on_the_fake_group_only() -> None:
    predictor = Predictor(ShardedAllReducing(network(), OPTIMIZERS["adam"]), None, BATCH)
    rank = predict_rank(predictor, StrategySpec("fsdp2", 4))
    assert isinstance(rank, RankStep), rank
    assert not dist.is_initialized()


@pytest.mark.replay
def test_the_fake_group_leaves_the_processs_excepthook_as_it_was() -> None:
    # init_process_group wraps sys.excepthook to prefix each traceback line with "[rank0]:" and
    # destroy_process_group leaves it: after a plan of 8 fsdp2 replays the user's next uncaught exception was printed
    # with every line prefixed "[rank0]: " 8 times
    hook = sys.excepthook
    for world_size in (2, 4):
        rank = predict_rank(
            Predictor(Classifier(network(), OPTIMIZERS["adam"]), None, BATCH), StrategySpec("fsdp2", world_size)
        )
        assert isinstance(rank, RankStep), rank
    assert sys.excepthook is hook  # was torch's _distributed_excepthook, wrapped once per replay


@pytest.mark.replay
@pytest.mark.parametrize("module", [ShardedMlp, Classifier])
def test_an_fsdp2_rank_with_cpu_offload_holds_its_shards_on_the_host(module: type[Classifier]) -> None:
    """torch's fully_shard runs with CPUOffloadPolicy(pin_memory=False); on the CPU the device's phases plus the
    host lines are the rank without offload (one memory), the host lines this rank's shards and their state."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    offloading: list[bool] = []
    init = _fsdp_param.FSDPParam.__init__.__code__

    def recorded(frame: FrameType, event: str, arg: object) -> None:
        """Each ``FSDPParam`` made, read as its ``__init__`` returns: a profile function, since a function of the
        test's installed as ``FSDPParam.__init__`` is one of the user's in a library class, and rules replays out."""
        if event == "return" and frame.f_code is init:
            offloading.append(frame.f_locals["self"].offload_to_cpu)

    predictor = Predictor(module(network(), OPTIMIZERS["adam"]), None, BATCH)
    sys.setprofile(recorded)
    try:
        kept = predict_rank(predictor, StrategySpec("fsdp2", 4))
        assert offloading and not any(offloading)
        offloading.clear()
        rank = predict_rank(predictor, StrategySpec("fsdp2", 4, offload=True))
    finally:
        sys.setprofile(None)
    assert isinstance(rank, RankStep) and isinstance(kept, RankStep), rank
    assert offloading and all(offloading)  # the module's configure_model and the usual policy alike
    assert rank.method.endswith("the reduce-scatter output and the activations on the device")
    shard = 2 * (padded(512, 512, 4) + padded(512, 1, 4)) + padded(10, 512, 4) + padded(10, 1, 4)
    host = [(line.label, line.bytes) for line in rank.lines if line.on_host]
    assert host == [
        ("FSDP2 offloaded sharded parameters (host)", shard),
        ("FSDP2 offloaded sharded gradients (host)", shard),
        ("FSDP2 offloaded optimizer state (host)", 2 * shard + 6 * FLOAT32),
    ]
    assert rank.host_bytes == 4 * shard + 6 * FLOAT32
    for phase in Phase:
        device, whole = rank.phases[phase], kept.phases[phase]
        assert device.breakdown is not None and whole.breakdown is not None
        assert device.breakdown.gradients == device.breakdown.optimizer_state == 0
        held = whole.breakdown.gradients + whole.breakdown.optimizer_state
        assert device.breakdown.parameters == whole.breakdown.parameters - shard  # the gathered units only
        assert device.peak_bytes == whole.peak_bytes - shard - held
    assert rank.phases[Phase.OPTIMIZER].breakdown.parameters == 0  # type: ignore[union-attr]
