"""A live sharded run's strategy, read from its own objects: what each rank's replay predicts it as.

DeepSpeed is read by attribute (DeepSpeed 0.19), so deepspeed is never imported: the ZeRO optimizer keeps its stage,
its partition count and its bucket settings on itself. ZeRO-3 empties ``param.data`` (the whole shapes are in
``param.ds_shape``): the replay's twin rebuilds the whole parameters
(:mod:`~lightning_vram.prediction.replay.unsharded`). FSDP2 (``fully_shard``: Lightning's
``ModelParallelStrategy``, Fabric's) is read from the module: a unit of it is an ``FSDPModule``, each unit's settings
on its FSDP state (:func:`~lightning_vram.prediction.strategies.fsdp2.live_units`), the world size from the default
process group (asked locally: no collective). FSDP1 (``FullyShardedDataParallel``: Lightning's ``fsdp`` strategy) is
read from the module too: its wrappers' sharding strategy and CPU offload, its flat parameters' sizes
(:func:`~lightning_vram.prediction.strategies.fsdp1.live_flats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_vram.measure.deepspeed_zero import wrapped_optimizer
from lightning_vram.measure.setup import user_optimizer
from lightning_vram.prediction.replay.unsharded import live_fsdp1, live_fsdp2
from lightning_vram.prediction.strategies._shards import optimizer_like
from lightning_vram.prediction.strategies.deepspeed import LIGHTNING_DEFAULTS, ZeroSettings
from lightning_vram.prediction.strategies.fsdp1 import LiveFlats, live_flats
from lightning_vram.prediction.strategies.fsdp2 import LiveUnits, live_units
from lightning_vram.records import StrategySpec

ZERO12_ATTRIBUTE = "single_partition_of_fp32_groups"
"""The attribute only DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) has: its fp32 master partition."""
ZERO3_ATTRIBUTE = "fp32_partitioned_groups_flat"
"""The attribute only DeepSpeed's ZeRO-3 optimizer has."""


@dataclass(frozen=True)
class LiveSharding:
    """A live sharded run as one rank predicts it.

    ``spec``: the strategy and world size. ``settings``: ZeRO's bucket settings, in elements (Lightning's defaults
    for FSDP2, which has none). ``optimizer``: the user's optimizer inside ZeRO's (its class and first group's
    settings size the partition's state); ``None`` for FSDP2 (the replay builds it on its shards: the module's
    ``configure_optimizers``, else one like :attr:`LiveUnits.optimizer`) and FSDP1. ``units``: FSDP2's units as the
    run sharded them, FSDP1's flat parameters as the run made them; ``None`` for ZeRO.
    """

    spec: StrategySpec
    settings: ZeroSettings
    optimizer: torch.optim.Optimizer | None
    units: LiveUnits | LiveFlats | None = None


def live_sharding(
    optimizers: Sequence[torch.optim.Optimizer], module: nn.Module | None = None, rank: int = 0
) -> LiveSharding | str | None:
    """The run's sharded strategy; why it is not modelled (a reason); ``None``: none.

    Read from its optimizers (ZeRO) and from ``module`` (FSDP2, FSDP1; this process is ``rank``).
    """
    if module is not None and live_fsdp2(module):
        distributed = torch.distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            return "fsdp2: the module is sharded but no process group is initialized"
        inner = user_optimizer(optimizers[0]) if optimizers else None  # Fabric's wrapper looked through
        units = live_units(module, rank, inner)
        if isinstance(units, str):
            return units
        spec = StrategySpec("fsdp2", distributed.get_world_size(), offload=units.offload)
        return LiveSharding(spec, LIGHTNING_DEFAULTS, None, units)
    if module is not None and live_fsdp1(module):
        return _fsdp1(optimizers, module)
    for optimizer in optimizers:
        if hasattr(optimizer, ZERO3_ATTRIBUTE):
            return _zero3(optimizer, module)
        if not hasattr(optimizer, ZERO12_ATTRIBUTE):
            continue
        counts = getattr(optimizer, "partition_count", None)
        world = counts[0] if isinstance(counts, list) and counts and isinstance(counts[0], int) else None
        if world is None:
            return "DeepSpeed ZeRO-1/2: its optimizer holds no partition count"
        stage = 2 if getattr(optimizer, "partition_gradients", False) else 1
        offload = bool(getattr(optimizer, "cpu_offload", False))
        settings = ZeroSettings(
            reduce_bucket_size=int(getattr(optimizer, "reduce_bucket_size", ZeroSettings.reduce_bucket_size)),
            allgather_bucket_size=int(getattr(optimizer, "allgather_bucket_size", ZeroSettings.allgather_bucket_size)),
            overlap_comm=bool(getattr(optimizer, "overlap_comm", ZeroSettings.overlap_comm)),
        )
        spec = StrategySpec(f"deepspeed_stage_{stage}", world, offload=offload)
        return LiveSharding(spec, settings, wrapped_optimizer(optimizer))
    return None


def _fsdp1(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module) -> LiveSharding | str:
    """A live FSDP1 rank: its world size, sharding strategy and flat parameters; or why it is not modelled."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return "fsdp (FSDP1): the module is wrapped but no process group is initialized"
    inner = user_optimizer(optimizers[0]) if optimizers else None  # Fabric's wrapper looked through
    flats = live_flats(module, inner)
    if isinstance(flats, str):
        return flats
    sharding, live = flats
    spec = StrategySpec("fsdp", distributed.get_world_size(), sharding=sharding)
    return LiveSharding(spec, LIGHTNING_DEFAULTS, None, live)


def _zero3(optimizer: torch.optim.Optimizer, module: nn.Module | None) -> LiveSharding | str:
    """A live ZeRO-3 rank: its partition count, bucket settings and offload from its optimizer; or why not modelled."""
    world = getattr(optimizer, "partition_count", None)
    if not isinstance(world, int):
        return "DeepSpeed ZeRO-3: its optimizer holds no partition count"
    if module is not None and any(getattr(parameter, "ds_persist", False) for parameter in module.parameters()):
        return (
            "DeepSpeed ZeRO-3 keeping parameters whole on every rank (under stage3_param_persistence_threshold):"
            " not modelled yet (the per-rank model partitions every parameter)"
        )
    settings = ZeroSettings(
        reduce_bucket_size=int(getattr(optimizer, "reduce_bucket_size", ZeroSettings.reduce_bucket_size)),
        stage3_prefetch_bucket_size=int(
            getattr(optimizer, "prefetch_elements", ZeroSettings.stage3_prefetch_bucket_size)
        ),
    )
    spec = StrategySpec("deepspeed_stage_3", world, offload=bool(getattr(optimizer, "offload_optimizer", False)))
    return LiveSharding(spec, settings, wrapped_optimizer(optimizer))


def unsharded_optimizer(
    inner: torch.optim.Optimizer, parameters: Sequence[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """An optimizer of ``inner``'s class and first group's settings over the unsharded ``parameters``, without state.

    ``inner`` steps ZeRO's flat partition; the replay's step runs over the module's own parameters. Made on the real
    parameters (nothing is stepped): the replay copies it to its fake ones.
    """
    return optimizer_like(inner, parameters)
