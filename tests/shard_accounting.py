"""Two processes shard a model with FSDP2 (``fully_shard``) on the CPU (gloo); each counts what it holds.

Run by tests/test_distributed.py: ``python tests/shard_accounting.py PORT OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_vram.measure.storages import (
    gradient_storages,
    model_state_bytes,
    optimizer_state_storages,
    parameter_storages,
)


def run(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    cpu = torch.device("cpu")
    parameters = parameter_storages(model, cpu)
    gradients = gradient_storages(model, cpu)
    counts = {
        "full_bytes": full_bytes,
        "parameters": sum(parameters.values()),
        "gradients": sum(gradients.values()),
        "optimizer_state": sum(optimizer_state_storages([optimizer], cpu, set(parameters) | set(gradients)).values()),
        "local_elements": sum(p.to_local().numel() for p in model.parameters()),  # type: ignore[operator]
        "model_state": list(model_state_bytes(model, [optimizer], cpu)),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    start_ranks(run, (int(sys.argv[1]), Path(sys.argv[2])), 2)
