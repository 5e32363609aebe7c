"""DeepSpeed ZeRO-2 and FSDP1 on 2 gloo CPU ranks training LightningModules that build their own optimizer, each
rank measured by VramSession: run by tests/test_zero_module_optimizer.py, ``python
tests/zero_module_optimizer_train.py PORT OUT_DIR``.

Two modules a user trains (:mod:`zero_modules`): a ResNet-style network with BatchNorm under SGD with momentum and a
transformer LM under AdamW, each ``configure_optimizers``'s optimizer given to ``deepspeed.initialize`` with the
small buckets of tests/zero_fsdp1_ranks.py, its ``training_step`` run through the engine, 3 optimizer steps, the
last sampled; then the transformer under FSDP1 as Lightning's ``fsdp`` row has it. Rank ``r`` writes
``rank<r>.json``: per run, each phase's peak, its counted parts and what gloo's thread released late of it
(tests/late_releases.py), bytes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from late_releases import released_late_of
from zero_fsdp1_ranks import zero_config
from zero_modules import MODULES, batch_of

from lightning_vram import VramSession

STEPS = 3
WORLD = 2


def train(name: str, rank: int) -> dict[str, Any]:
    return measured_step(name, rank, {**zero_config(2), "train_micro_batch_size_per_gpu": batch_of(name)[0].shape[0]})


def measured_step(name: str, rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """The module ``name`` trained on this rank by DeepSpeed under ``config``: its last step's phases."""
    return deepspeed_step(MODULES[name], lambda generator: batch_of(name, generator), rank, config)


def deepspeed_step(
    build: Callable[[], Any], batches: Callable[[torch.Generator], Any], rank: int, config: dict[str, Any]
) -> dict[str, Any]:
    """The LightningModule ``build`` makes (under seed 0) trained on this rank by DeepSpeed under ``config``, each
    batch drawn by ``batches`` from the rank's generator: its last step's phases (bytes)."""
    import deepspeed  # type: ignore[import-untyped]

    torch.manual_seed(0)
    module = build()
    optimizer = module.configure_optimizers()
    module.forward = module.training_step  # the engine runs the step
    engine, optimizer, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, dist_init_required=False
    )
    session = VramSession(
        attribution_start_step=STEPS - 1,
        attribution_every_n_steps=None,
        console_summary=False,
        replay_budget_seconds=0.0,
        preflight=False,
    )
    late = released_late_of(session)
    session.start(module, [optimizer], device=torch.device("cpu"), wrapper=lambda: engine)
    generator = torch.Generator().manual_seed(rank)
    for index in range(STEPS):
        batch = batches(generator)
        session.batch_start(batch)
        loss = engine(batch, index)
        session.before_backward()
        engine.backward(loss)
        session.before_optimizer_step()
        engine.step()
        session.batch_end(index)
    report = session.finish(gather_ranks=False)
    assert report is not None
    return {
        phase.value: {
            "peak": peak.peak_bytes,
            **peak.breakdown.to_dict(),  # type: ignore[union-attr]
            "released late": late.get(phase.value, 0),
        }
        for phase, peak in report.phases.items()
    }


def train_fsdp1(name: str, rank: int) -> dict[str, Any]:
    """Lightning's ``fsdp`` as a plan's row has it, in a plain loop (Lightning's refuses the CPU): the root wrapped
    alone, ``use_orig_params=True``, FULL_SHARD, the gradients set to None between the step's forward and its
    backward as Lightning's loop does."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    module = MODULES[name]()
    module.forward = module.training_step  # the wrapper runs the step
    wrapped = FullyShardedDataParallel(module, use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = type(module.configure_optimizers())(wrapped.parameters(), lr=1e-3)
    session = VramSession(
        attribution_start_step=STEPS - 1,
        attribution_every_n_steps=None,
        console_summary=False,
        replay_budget_seconds=0.0,
        preflight=False,
    )
    late = released_late_of(session)
    session.start(wrapped, [optimizer], device=torch.device("cpu"), wrapper=lambda: wrapped)
    generator = torch.Generator().manual_seed(rank)
    for index in range(STEPS):
        batch = batch_of(name, generator)
        session.batch_start(batch)
        loss = wrapped(batch, index)
        optimizer.zero_grad()
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        session.batch_end(index)
    report = session.finish(gather_ranks=False)
    assert report is not None
    return {
        phase.value: {
            "peak": peak.peak_bytes,
            **peak.breakdown.to_dict(),  # type: ignore[union-attr]
            "released late": late.get(phase.value, 0),
        }
        for phase, peak in report.phases.items()
    }


def run_rank(rank: int, port: int, out: Path) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {name: train(name, rank) for name in MODULES}
    results["fsdp transformer"] = train_fsdp1("transformer", rank)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    start_ranks(run_rank, (int(sys.argv[1]), Path(sys.argv[2])), WORLD, ("deepspeed",))
