"""Two processes train with DeepSpeed ZeRO on the CPU (gloo); each counts, step by step, what it holds.

Run by tests/test_distributed.py: ``python tests/zero_accounting.py STAGES PORT OUT_DIR`` (``STAGES`` such as ``1,2,3``:
each stage in turn in the same two processes, one DeepSpeed import and one process group for all; each rank writes
``rank{RANK}.stage{STAGE}.json``). Each rank drives
``StepAttributor`` at the points where VramMonitor's hooks run under Lightning's DeepSpeed strategy (batch start,
before ``engine.backward``, before ``engine.step``, batch end) and writes the counts beside independent figures: the
whole parameter count, and each parameter's ZeRO-3 partition size as ``ceil(numel / world size)``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # type: ignore[import-untyped]
import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from torch import nn

from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.deepspeed_zero import full_numel, wrapped_optimizer
from lightning_vram.measure.storages import model_state_bytes

WORLD_SIZE = 2
STEPS = 2


def run(rank: int, stages: list[int], port: int, out: Path) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))  # DeepSpeed reads these
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    for stage in stages:
        count_stage(rank, stage, out)
    dist.destroy_process_group()


def count_stage(rank: int, stage: int, out: Path) -> None:
    """Train a fresh model with ZeRO ``stage`` for ``STEPS`` steps; write this rank's counts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 50))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    cpu = torch.device("cpu")
    counts: dict[str, object] = {
        "numel": sum(full_numel(p) for p in model.parameters()),
        "partition_numel": sum(math.ceil(full_numel(p) / WORLD_SIZE) for p in model.parameters()),
        "wrapped_optimizer": type(wrapped_optimizer(optimizer)).__name__,
    }
    for step in range(STEPS):
        attributor = StepAttributor(step, model, [optimizer], cpu)
        batch = torch.randn(4, 100)
        attributor.begin_forward(batch)
        loss = engine(batch).square().mean()
        attributor.before_backward()
        engine.backward(loss)
        counts["after_backward"] = model_state_bytes(model, [optimizer], cpu)
        attributor.before_optimizer_step()
        engine.step()
        counts["after_step"] = model_state_bytes(model, [optimizer], cpu)
        attribution = attributor.finish()
    counts["phases"] = {
        phase.value: [breakdown.parameters, breakdown.gradients, breakdown.optimizer_state, breakdown.activations]
        for phase, breakdown in attribution.phases.items()
    }
    counts["saved_activation_bytes"] = sum(profile.activation_bytes for profile in attribution.modules)
    (out / f"rank{rank}.stage{stage}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    stages = [int(stage) for stage in sys.argv[1].split(",")]
    start_ranks(run, (stages, int(sys.argv[2]), Path(sys.argv[3])), WORLD_SIZE, ("deepspeed",))
