"""DeepSpeed ZeRO 1-3 and FSDP1 on WORLD CPU processes (gloo), each rank measured by VramSession.

Run by tests/test_rank_prediction_zero.py: ``python tests/zero_fsdp1_ranks.py WORLD PORT OUT_DIR [ACCUMULATE]``.
Every rank trains the same small transformer (:func:`transformer`) two optimizer steps under each strategy in turn
(one process start and one DeepSpeed import per world size), with a plain loop driving
:class:`~lightning_vram.VramSession` at the points where VramMonitor's hooks run (batch start, before backward,
before the optimizer step, batch end), the last micro-batch sampled. Each rank writes its report's phases (peak and
breakdown) to ``rankN.json``. With ACCUMULATE (1 unless given) micro-batches per optimizer step, each strategy
accumulates as it does under Lightning: FSDP1 runs the window's earlier micro-batches in ``no_sync()`` and steps on
the last; DeepSpeed gets ``gradient_accumulation_steps`` and its engine's ``backward`` and ``step`` run on every
micro-batch (Lightning's ``DeepSpeedStrategy`` handles accumulation so: the hook before the optimizer step runs on
each), the engine stepping the optimizer at the window's boundary.

DeepSpeed runs with the ZeRO settings Lightning's ``DeepSpeedStrategy`` writes (``contiguous_gradients``,
``overlap_comm``, ``zero_allow_untested_optimizer``) with the two bucket sizes set small (:data:`ZERO_SETTINGS`),
as a user of a small model would: Lightning's default of 2e8 elements would hold 800 MB per rank on the CPU.
FSDP1 is torch's ``FullyShardedDataParallel`` (Lightning's ``fsdp`` strategy refuses the CPU), each encoder layer
its own unit and the root the rest, ``use_orig_params=False`` (flat parameters), under ``FULL_SHARD``,
``SHARD_GRAD_OP`` and ``NO_SHARD``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from late_releases import released_late_of
from torch import nn

from lightning_vram import VramSession
from lightning_vram.records import Report

STEPS = 2
BATCH_SHAPE = (4, 16, 64)
"""Per-rank batch: 4 sequences of 16 positions, 64 features."""
ZERO_SETTINGS: dict[str, Any] = {
    "contiguous_gradients": True,
    "overlap_comm": True,
    "reduce_bucket_size": 20_000,
    "allgather_bucket_size": 20_000,
    "stage3_prefetch_bucket_size": 20_000,
    "stage3_param_persistence_threshold": 0,
}
"""The ZeRO settings of the runs (elements), beside the stage."""
STRATEGIES = (
    "fsdp",
    "fsdp SHARD_GRAD_OP",
    "fsdp NO_SHARD",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
)
"""The runs, in order: FSDP1 under a sharding strategy (FULL_SHARD where none is named), then ZeRO."""


def transformer() -> nn.Module:
    """Two encoder layers (d_model 64, 4 heads, feed-forward 128, no dropout) and a 10-way head: 67,594 parameters."""
    layers = [nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True) for _ in range(2)]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def zero_config(stage: int, accumulate: int = 1) -> dict[str, Any]:
    """The DeepSpeed config of a run at ``stage`` accumulating ``accumulate`` micro-batches."""
    return {
        "train_micro_batch_size_per_gpu": BATCH_SHAPE[0],
        "gradient_accumulation_steps": accumulate,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, **ZERO_SETTINGS},
    }


def record(report: Report, late: dict[str, int]) -> dict[str, Any]:
    """A report's phases: each phase's peak, its breakdown's parts, and of the peak the bytes gloo's worker thread
    released late (``late``, tests/late_releases.py), in bytes."""
    phases: dict[str, Any] = {}
    for phase, peak in report.phases.items():
        breakdown = peak.breakdown
        assert breakdown is not None
        released = late.get(phase.value, 0)
        phases[phase.value] = {"peak": peak.peak_bytes, **breakdown.to_dict(), "released late": released}
    return phases


def train(name: str, rank: int, accumulate: int) -> dict[str, Any]:
    """Two optimizer steps of ``name`` on this rank, measured; the report's phases."""
    torch.manual_seed(0)
    model = transformer()
    optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = VramSession(
        attribution_start_step=STEPS * accumulate - 1,
        attribution_every_n_steps=None,
        console_summary=False,
        replay_budget_seconds=0.0,
        preflight=False,
    )
    if name.startswith("fsdp"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped: Any = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[name.partition(" ")[2] or "FULL_SHARD"],
            auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
            use_orig_params=False,
            device_id=torch.device("cpu"),  # without it FSDP1 asks for an accelerator
        )
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
        measured, run, backward, step = wrapped, wrapped, (lambda loss: loss.backward()), optimizer.step
    else:
        import deepspeed  # type: ignore[import-untyped]

        stage = int(name.removeprefix("deepspeed_stage_"))
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=zero_config(stage, accumulate), dist_init_required=False
        )
        measured, run, backward, step = model, engine, engine.backward, engine.step
    late = released_late_of(session)
    session.start(measured, [optimizer], device=torch.device("cpu"), wrapper=lambda: run)
    generator = torch.Generator().manual_seed(rank)
    for index in range(STEPS * accumulate):
        last = (index + 1) % accumulate == 0  # the window's last micro-batch: the optimizer steps
        fsdp = name.startswith("fsdp")
        batch = torch.randn(*BATCH_SHAPE, generator=generator)
        session.batch_start(batch)
        with contextlib.nullcontext() if last or not fsdp else run.no_sync():
            loss = run(batch).square().mean()
            session.before_backward()
            backward(loss)
        if last or not fsdp:
            session.before_optimizer_step()
            step()
        if fsdp and last:
            optimizer.zero_grad(set_to_none=True)
        session.batch_end(index)
    report = session.finish(gather_ranks=False)
    assert report is not None
    return record(report, late)


def run_rank(rank: int, world: int, port: int, out: Path, accumulate: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {name: train(name, rank, accumulate) for name in STRATEGIES}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = int(sys.argv[1])
    accumulation = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    start_ranks(run_rank, (world_size, int(sys.argv[2]), Path(sys.argv[3]), accumulation), world_size, ("deepspeed",))
