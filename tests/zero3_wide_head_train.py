"""DeepSpeed ZeRO-3 on 2 gloo CPU ranks training a model whose last layer is wider than the reduce bucket, each rank
measured by VramSession: run by tests/test_zero3_wide_head.py.

:class:`WideHead` (two 64-wide ``Linear`` layers, then a ``Linear(64, 2000)`` head: 128,000 weight elements, the
reduce bucket 20,000) under Adam, the small buckets of tests/zero_fsdp1_ranks.py, 3 optimizer steps, the last
sampled, at the ``stage3_prefetch_bucket_size`` given in elements (``python tests/zero3_wide_head_train.py PORT
OUT_DIR PREFETCH``: 20,000 as the other runs', or DeepSpeed's default as tests/zero3_prefetch_train.py's, both less
than the head). Rank ``r`` writes ``rank<r>.json``: each phase's peak, its counted parts and what gloo's thread
released late of it (tests/late_releases.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from lightning.pytorch import LightningModule
from torch import nn
from zero_fsdp1_ranks import zero_config
from zero_module_optimizer_train import WORLD, deepspeed_step

CLASSES = 2000
"""The head's width: its weight gradient (128,000 elements) is more than the runs' 20,000-element reduce bucket."""


class WideHead(LightningModule):
    """Two hidden ``Linear(64, 64)`` layers with ReLU, then a ``Linear(64, 2000)`` head, cross-entropy, Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, CLASSES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(self.head(self.body(inputs)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def batch_of(generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 8 inputs and their labels."""
    return torch.randn(8, 64, generator=generator), torch.randint(0, CLASSES, (8,), generator=generator)


def measured_step(rank: int, prefetch: int) -> dict[str, Any]:
    """:class:`WideHead` trained on this rank by DeepSpeed ZeRO-3: its last step's phases."""
    config = {**zero_config(3), "train_micro_batch_size_per_gpu": 8}
    config["zero_optimization"] = {**config["zero_optimization"], "stage3_prefetch_bucket_size": prefetch}
    return deepspeed_step(WideHead, batch_of, rank, config)


def run_rank(rank: int, port: int, out: Path, prefetch: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    (out / f"rank{rank}.json").write_text(json.dumps(measured_step(rank, prefetch)))
    dist.destroy_process_group()


if __name__ == "__main__":
    start_ranks(run_rank, (int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])), WORLD, ("deepspeed",))
