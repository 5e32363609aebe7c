"""What a gloo rank's training did, as the multi-process test scripts write it (``training<rank>.json``,
``run<rank>.json``) to compare a run with the monitor against the same run without it.

Floats are written exactly (``float.hex``); each script builds its record from these parts and keeps only what is
its own (its steps' counters, its ZeRO partitions, its replay's fields).
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

from lightning_vram import VramMonitorWarning


def tensor_hex(value: Any) -> Any:
    """A tensor's values on this rank (a DTensor's local shard), flattened, each exactly as ``float.hex``; anything
    else (an optimizer state's plain number) as it is."""
    if isinstance(value, torch.Tensor):
        shard = value.to_local() if hasattr(value, "to_local") else value
        return [item.hex() for item in shard.detach().flatten().double().tolist()]
    return value


def parameters_hex(module: torch.nn.Module) -> dict[str, Any]:
    """Each of ``module``'s named parameters (this rank's shard of it), exactly."""
    return {name: tensor_hex(tensor) for name, tensor in module.named_parameters()}


def optimizer_hex(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter's optimizer state (this rank's shards), exactly, in the order of the optimizer's groups."""
    return [
        {key: tensor_hex(value) for key, value in optimizer.state[parameter].items()}
        for group in optimizer.param_groups
        for parameter in group["params"]
    ]


def torch_rng() -> list[int]:
    """torch's global CPU generator's state."""
    return torch.get_rng_state().tolist()


def rng_states(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG's state: torch's (``rng``), the user's ``generator``'s and Python's (``python rng``)."""
    return {"rng": torch_rng(), "generator": generator.get_state().tolist(), "python rng": repr(random.getstate())}


def groups_left() -> dict[str, Any]:
    """The process groups left in ``torch.distributed``: their names, sorted, and how many rank maps it holds."""
    return {
        "groups": sorted(str(name) for name in c10d._world.pg_names.values()),
        "group ranks": len(c10d._world.pg_group_ranks),
    }


def sharded_training(losses: list[str], module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A sharded rank's training: each step's loss (hex), its shards of the parameters and of the optimizer's state,
    torch's RNG state."""
    return {
        "losses": losses,
        "parameters": parameters_hex(module),
        "optimizer": optimizer_hex(optimizer),
        "rng": torch_rng(),
    }


def monitor_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The monitor's warnings among those ``caught``, as text."""
    return [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON to ``path``."""
    path.write_text(json.dumps(record))
