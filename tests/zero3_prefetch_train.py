"""DeepSpeed ZeRO-3 on 2 gloo CPU ranks at DeepSpeed's default ``stage3_prefetch_bucket_size`` (Lightning's
``DeepSpeedStrategy`` sets none), every parameter partitioned (``stage3_param_persistence_threshold`` 0), each rank
measured by VramSession: run by tests/test_zero3_prefetch.py, ``python tests/zero3_prefetch_train.py PORT OUT_DIR``.

The modules of :mod:`zero_modules` (a ResNet-style network under SGD with momentum, a transformer LM under AdamW),
each ``configure_optimizers``'s optimizer given to ``deepspeed.initialize`` with the small reduce and all-gather
buckets of tests/zero_fsdp1_ranks.py, 3 optimizer steps, the last sampled. Rank ``r`` writes ``rank<r>.json``: per
module, each phase's peak, its counted parts and what gloo's thread released late of it (tests/late_releases.py).
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
from zero_fsdp1_ranks import zero_config
from zero_module_optimizer_train import STEPS, WORLD, measured_step
from zero_modules import MODULES, batch_of

PREFETCH = 50_000_000
"""DeepSpeed 0.19's default ``stage3_prefetch_bucket_size``, in elements: more than either module's parameters."""


def config_of(name: str) -> dict[str, Any]:
    """The run's DeepSpeed config: ZeRO-3 with the small buckets, DeepSpeed's default prefetch bucket."""
    config = {**zero_config(3), "train_micro_batch_size_per_gpu": batch_of(name)[0].shape[0]}
    config["zero_optimization"] = {**config["zero_optimization"], "stage3_prefetch_bucket_size": PREFETCH}
    return config


def run_rank(rank: int, port: int, out: Path) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {name: measured_step(name, rank, config_of(name)) for name in MODULES}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    assert STEPS == 3
    start_ranks(run_rank, (int(sys.argv[1]), Path(sys.argv[2])), WORLD, ("deepspeed",))
