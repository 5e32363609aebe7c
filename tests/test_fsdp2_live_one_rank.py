"""A live FSDP2 rank replayed in one process (a gloo group of one rank): the module left exactly as it was.

The replay copies the ``fully_shard``-ed module unsharded and shards the copy again over fake groups made beside
the run's; the groups are gone after it, the live module's parameters, classes and hooks untouched, and a collective
of the run's own group inside the step still stops the replay. tests/test_fsdp2_live.py checks two ranks on gloo.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import OPTIMIZERS, Classifier
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_vram.prediction.containment.collectives import CollectiveError, NoCollectives
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay._fake import FakeTensorMode
from lightning_vram.prediction.strategies.fsdp2 import side_meshes
from lightning_vram.prediction.strategies.live import LiveSharding, live_sharding
from lightning_vram.prediction.strategies.rank_replays import RankReplays
from lightning_vram.records import Phase, ReplayedStep, ReplaySkipped, StrategySpec

pytestmark = pytest.mark.replay

FLOAT32 = 4
BATCH = (torch.randn(8, 256), torch.randint(0, 10, (8,)))
PARAMETERS = 2 * (256 * 256 + 256) * FLOAT32 + (256 * 10 + 10) * FLOAT32
"""The MLP's parameters (bytes): at world size 1 each shard is the whole parameter."""


class AllReducesItsLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        dist.all_reduce(loss.detach().clone())  # a collective of the run's own group inside the step
        return loss


class MakesAGroup(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dist.barrier(group=dist.new_group([0]))  # a group of the run's ranks made inside the step
        return super().training_step(batch, batch_idx)


def sharded(kind: type[Classifier] = Classifier) -> Classifier:
    """The MLP with each Linear and then the network ``fully_shard``-ed over the run's (gloo) group."""
    network = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    module = kind(network, OPTIMIZERS["adam"])
    mesh = init_device_mesh("cpu", (1,))
    for layer in network:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(network, mesh=mesh)
    return module


def replays_of(module: nn.Module) -> RankReplays:
    sharding = live_sharding([], module, 0)
    assert isinstance(sharding, LiveSharding), sharding
    assert sharding.spec == StrategySpec("fsdp2", 1) and sharding.units is not None
    assert [unit.name for unit in sharding.units.units] == ["network", "network.0", "network.2", "network.4"]
    predictor = Predictor(module, None, BATCH, warm_up=True)
    return RankReplays(predictor, sharding.spec, sharding.settings, 0, sharding.units)


def test_a_live_fsdp2_rank_is_replayed_and_its_module_left_as_it_was(gloo_one_rank: None) -> None:
    from torch.distributed import distributed_c10d as c10d

    module = sharded()
    parameters = {name: (parameter, parameter.to_local().clone()) for name, parameter in module.named_parameters()}
    classes = [type(child) for child in module.modules()]
    hooks = [(dict(child._forward_pre_hooks), dict(child._forward_hooks)) for child in module.modules()]
    groups = dict(c10d._world.pg_names)
    step = replays_of(module).replay()
    assert isinstance(step, ReplayedStep), step
    optimizer = step.phases[Phase.OPTIMIZER].breakdown
    assert optimizer is not None
    assert (optimizer.parameters, optimizer.gradients, optimizer.optimizer_state) == (
        PARAMETERS,
        PARAMETERS,
        2 * PARAMETERS + 6 * FLOAT32,  # Adam's two moments and each of the 6 parameters' step count
    )
    assert dict(c10d._world.pg_names) == groups and dist.get_backend() == "gloo"  # the fake groups are gone
    assert [type(child) for child in module.modules()] == classes
    assert [(dict(child._forward_pre_hooks), dict(child._forward_hooks)) for child in module.modules()] == hooks
    for name, (parameter, values) in parameters.items():
        now = module.get_parameter(name)
        assert now is parameter and type(now).__name__ == "DTensor" and now.grad is None, name
        assert torch.equal(now.to_local(), values), name


def test_a_collective_of_the_run_s_group_in_a_live_fsdp2_step_stops_the_replay(gloo_one_rank: None) -> None:
    step = replays_of(sharded(AllReducesItsLoss)).replay()
    assert isinstance(step, ReplaySkipped)
    assert step.reason.startswith("the step runs a collective (c10d.allreduce_.default): a rank's replay runs none")


def test_a_process_group_made_in_a_live_fsdp2_step_stops_the_replay_before_it_is_made(gloo_one_rank: None) -> None:
    # Before: the replay made the group, left it in torch.distributed (the run's later groups named one further on)
    # and stopped at its barrier.
    from torch.distributed import distributed_c10d as c10d

    module = sharded(MakesAGroup)
    groups, count = dict(c10d._world.pg_names), c10d._world.group_count
    step = replays_of(module).replay()
    assert isinstance(step, ReplaySkipped)
    assert step.reason.startswith("the step makes a process group (torch.distributed.new_group)")
    assert dict(c10d._world.pg_names) == groups and c10d._world.group_count == count
    assert c10d._new_group_with_tag.__name__ == "_new_group_with_tag"  # torch's own, put back


def test_a_live_fsdp2_module_without_configure_optimizers_is_replayed_with_an_optimizer_like_the_run_s(
    gloo_one_rank: None,
) -> None:
    # A Fabric or plain loop's module: no configure_optimizers; the run's optimizer (AdamW, weight decay 0.5) gives
    # the replay's copy one of the same class and settings over its shards.
    network = sharded().network
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3, weight_decay=0.5)

    def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(module(inputs), targets)

    sharding = live_sharding([optimizer], network, 0)
    assert isinstance(sharding, LiveSharding) and sharding.units is not None
    assert sharding.units.optimizer is optimizer
    predictor = Predictor(network, None, BATCH, step_function=loss_of, warm_up=True)
    step = RankReplays(predictor, sharding.spec, sharding.settings, 0, sharding.units).replay()
    assert isinstance(step, ReplayedStep), step
    state = step.phases[Phase.OPTIMIZER].breakdown
    assert state is not None and state.optimizer_state == 2 * PARAMETERS + 6 * FLOAT32  # AdamW's, as Adam's
    assert optimizer.state == {} and not hasattr(network, "configure_optimizers")


def test_a_functional_gather_over_a_side_group_and_its_wait_run_in_a_replay(gloo_one_rank: None) -> None:
    # DTensor.full_tensor() on a replayed copy's parameter: an all-gather over the copy's fake group, then the wait
    # on its result (no group named). Before: the wait was refused as a collective, the replay skipped.
    import torch.distributed._functional_collectives as funcol

    with side_meshes(1, 0, "cpu") as (flat, _lightning), FakeTensorMode(), NoCollectives():  # type: ignore[no-untyped-call]
        whole = funcol.wait_tensor(funcol.all_gather_single(torch.empty(4), 0, flat.get_group()))
        assert whole.shape == (4,)
        with pytest.raises(CollectiveError, match=r"\(_c10d_functional\.all_gather_into_tensor"):
            funcol.all_gather_single(torch.empty(4), 0, dist.group.WORLD)  # the run's group: refused before the wait


def test_a_live_fsdp2_rank_offloading_to_the_cpu_is_replayed_offloading(gloo_one_rank: None) -> None:
    # Before: "fsdp2 with CPU offload: not modelled yet". The copy is sharded again with CPUOffloadPolicy; on the CPU
    # the rank's phases are its device's and host's together (one memory), the host lines its shards and state.
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from lightning_vram.prediction.strategies import fsdp2

    network = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    module = Classifier(network, OPTIMIZERS["adam"])
    mesh = init_device_mesh("cpu", (1,))
    for layer in network:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(network, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    sharding = live_sharding([], module, 0)
    assert isinstance(sharding, LiveSharding) and isinstance(sharding.units, fsdp2.LiveUnits), sharding
    assert sharding.spec == StrategySpec("fsdp2", 1, offload=True)
    assert [unit.offload for unit in sharding.units.units] == [True] * 4
    offloading: list[bool] = []
    init = _fsdp_param.FSDPParam.__init__.__code__

    def recorded(frame: FrameType, event: str, arg: Any) -> None:
        """Each ``FSDPParam`` made, read as its ``__init__`` returns: a profile function, since a function of the
        test's installed as ``FSDPParam.__init__`` is one of the user's in a library class, and rules replays out."""
        if event == "return" and frame.f_code is init:
            offloading.append(frame.f_locals["self"].offload_to_cpu)

    predictor = Predictor(module, None, BATCH, warm_up=True)
    sys.setprofile(recorded)
    try:
        rank = fsdp2.predict(predictor, sharding.spec, None, sharding.units)
        step = RankReplays(predictor, sharding.spec, sharding.settings, 0, sharding.units).replay()
    finally:
        sys.setprofile(None)
    assert offloading == [True] * 12  # the copy's 6 parameters, sharded again twice
    assert not isinstance(rank, ReplaySkipped) and isinstance(step, ReplayedStep), (rank, step)
    host = {line.label: line.bytes for line in rank.lines if line.on_host}
    assert host == {
        "FSDP2 offloaded sharded parameters (host)": PARAMETERS,
        "FSDP2 offloaded sharded gradients (host)": PARAMETERS,
        "FSDP2 offloaded optimizer state (host)": 2 * PARAMETERS + 6 * FLOAT32,
    }
    for phase in Phase:
        device, whole = rank.phases[phase], step.phases[phase]
        assert device.breakdown is not None and whole.breakdown is not None
        held = whole.breakdown.parameters - device.breakdown.parameters
        assert held == PARAMETERS
        assert (
            whole.peak_bytes == device.peak_bytes + held + whole.breakdown.gradients + whole.breakdown.optimizer_state
        )
    assert step.notes[-1].startswith("fsdp2 x1 offload: replayed: torch's fully_shard under a fake process group; CPU")
