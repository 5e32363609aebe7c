"""A live FSDP1 rank replayed in one process (a gloo group of one rank): the module left exactly as it was.

The replay copies the ``FullyShardedDataParallel``-wrapped module unsharded (a shell in each wrapper's place, each
original parameter whole, no flat parameter); the live wrappers, flat parameters, their values and FSDP1's hooks are
untouched. tests/test_fsdp1_live.py checks two ranks on gloo.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies.fsdp1 import LiveFlats
from lightning_vram.prediction.strategies.live import LiveSharding, live_sharding
from lightning_vram.prediction.strategies.rank_replays import RankReplays
from lightning_vram.records import Phase, ReplayedStep, StrategySpec

pytestmark = pytest.mark.replay

FLOAT32 = 4
BATCH = (torch.randn(8, 256), torch.randint(0, 10, (8,)))
UNITS = (256 * 256 + 256, 256 * 256 + 256, 256 * 10 + 10)
"""Each unit's flat parameter (a linear layer each; the root holds none of its own), in elements."""
PARAMETERS = sum(UNITS) * FLOAT32
"""Under NO_SHARD each rank holds the whole flat parameters."""


def flat_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Each FSDP1 unit's flat parameter, read from its handle (the root's holds none)."""
    handles = [child._handle for child in module.modules() if isinstance(child, FullyShardedDataParallel)]
    return [handle.flat_param for handle in handles if handle is not None]


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs), targets)


def wrapped(orig: bool) -> nn.Module:
    """The MLP, each Linear an FSDP1 unit and the root the rest, over the run's (gloo) group."""
    network = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return FullyShardedDataParallel(
        network,
        sharding_strategy=ShardingStrategy.NO_SHARD,  # what FSDP1 runs at world size 1 (it warns, given another)
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=orig,
        device_id=torch.device("cpu"),
    )


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig-params"])
def test_a_live_fsdp1_rank_is_replayed_and_its_module_left_as_it_was(gloo_one_rank: None, orig: bool) -> None:
    module = wrapped(orig)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.5)
    loss_of(module, BATCH).backward()  # a real step first: the flat parameters' gradients and Adam's state exist
    optimizer.step()  # the gradients kept (no zero_grad): the replay must leave them
    parameters = {
        name: (parameter, parameter.detach().clone(), parameter.grad.clone())
        for name, parameter in module.named_parameters()
        if parameter.grad is not None
    }
    assert len(parameters) == len(list(module.parameters()))
    flats = flat_parameters(module)
    assert len(flats) == len(UNITS)
    classes = [type(child) for child in module.modules()]
    attributes = [dict(vars(child)) for child in module.modules()]
    sharding = live_sharding([optimizer], module, 0)
    assert isinstance(sharding, LiveSharding), sharding
    assert sharding.spec == StrategySpec("fsdp", 1, sharding="NO_SHARD")
    assert isinstance(sharding.units, LiveFlats) and sharding.units.optimizer is optimizer
    assert sorted(sharding.units.numels) == sorted(UNITS)
    predictor = Predictor(module, None, BATCH, step_function=loss_of, warm_up=True)
    step = RankReplays(predictor, sharding.spec, sharding.settings, 0, sharding.units).replay()
    assert isinstance(step, ReplayedStep), step
    state = step.phases[Phase.OPTIMIZER].breakdown
    assert state is not None
    assert (state.parameters, state.gradients) == (PARAMETERS, PARAMETERS)
    assert state.optimizer_state == 2 * PARAMETERS + 3 * FLOAT32  # AdamW's two moments, a step count per unit
    assert [type(child) for child in module.modules()] == classes
    assert [dict(vars(child)) for child in module.modules()] == attributes  # hooks, handles, views: the same objects
    for name, (parameter, values, grad) in parameters.items():
        now = module.get_parameter(name)
        assert now is parameter and torch.equal(now.detach(), values), name
        assert now.grad is not None and torch.equal(now.grad, grad), name
    assert flat_parameters(module) == flats
    assert not hasattr(module, "configure_optimizers")


def test_a_live_fsdp1_rank_offloading_its_parameters_is_not_replayed_saying_why(gloo_one_rank: None) -> None:
    network = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    module = FullyShardedDataParallel(
        network,
        sharding_strategy=ShardingStrategy.NO_SHARD,
        cpu_offload=CPUOffload(offload_params=True),
        device_id=torch.device("cpu"),
    )
    assert live_sharding([], module, 0) == (
        "fsdp (FSDP1) with CPU offload: a live rank is not modelled yet (FSDP1 pins its offloaded shards, which torch"
        " refuses without an accelerator, so no CPU run checks it)"
    )
