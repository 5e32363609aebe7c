"""A live FSDP1 run on two CPU ranks (gloo), each rank's replay beside its step.

Run by tests/test_fsdp1_live.py: ``python tests/fsdp1_live_train.py OUT_DIR [no-monitor | preflight=FREE] [orig]``.
Lightning's ``fsdp`` strategy refuses the CPU, and so does Fabric's ("FSDP is only available on GPU", Lightning
2.x), so a plain loop wraps the MLP of tests/fsdp2_live_train.py in torch's
``FullyShardedDataParallel`` (each linear layer a unit, the root the rest; ``FULL_SHARD``; flat parameters, or with
``orig`` ``use_orig_params=True``) and drives :class:`~lightning_vram.VramSession` (no ``configure_optimizers``:
the replay builds an Adam like the run's on its copy's whole parameters), 4 steps, step 2 sampled. Rank ``r`` writes
``rank<r>.json`` (the simulation's skip reason, notes, measured and replayed peaks, advice) and ``training<r>.json``
(losses, its shards of the flat parameters and of Adam's state, the RNG's state). With ``preflight=FREE_BYTES`` each
rank's session reads a scripted CUDA device with that many bytes free (``ScriptedProbe``) and rank ``r`` writes
``preflight<r>.json``: the rows the ranks agreed on, its own verdict and the session's warnings.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp
from forked_ranks import start_ranks
from fsdp2_live_train import BATCH, WIDTH, WORLD_SIZE
from preflight_records import preflight_record
from replay_records import advice_rows, match_rows, phase_peaks, released_late
from training_records import sharded_training, write_record

from lightning_vram import VramMonitorWarning, VramSession
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

STEPS = 4


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs), targets)


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's numbers (one collective of the session's, outside any replay)."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, values)
    return rows


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, session: VramSession | None, rank: int) -> list[str]:
    """The run's steps on this rank, driving ``session`` where given; each step's loss (hex)."""
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for index in range(STEPS):
        batch = (torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        if session is not None:
            session.batch_start(batch)
        loss = loss_of(model, batch)
        if session is not None:
            session.before_backward()
        loss.backward()
        if session is not None:
            session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        if session is not None:
            session.batch_end(index)
        losses.append(loss.item().hex())
    return losses


def run_rank(rank: int, port: int, out: Path, mode: list[str]) -> None:
    monitored, orig = "no-monitor" not in mode, "orig" in mode
    free = [int(option.removeprefix("preflight=")) for option in mode if option.startswith("preflight=")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        activation_mlp(nn.LeakyReLU, width=WIDTH),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=orig,
        device_id=torch.device("cpu"),  # without it FSDP1 asks for an accelerator
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if free:
        probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], free_bytes=free[0])
        session = VramSession(probe=probe, attribution_start_step=100, console_summary=False)
    else:
        session = VramSession(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    if monitored:
        session.start(
            model,
            [optimizer],
            device=torch.device("cpu"),
            rank=rank,
            world_size=WORLD_SIZE,
            gather=gather,
            step_function=loss_of,
        )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", VramMonitorWarning)
        losses = steps(model, optimizer, session if monitored else None, rank)
    if free:
        preflight = preflight_record(session, seen)
        write_record(out / f"preflight{rank}.json", preflight)
        session.finish(gather_ranks=False)
    elif monitored:
        report = session.finish(gather_ranks=False)
        simulation = session.simulation
        assert report is not None and simulation is not None
        baseline, match = simulation.baseline, simulation.match
        record = {
            "skipped": simulation.skipped,
            "notes": [] if baseline is None else list(baseline.notes),
            "match": match_rows(match),
            "released_late": released_late(match),
            "variants": [[type(variant.change).__name__, variant.discarded] for variant in simulation.variants],
            "measured_peaks": phase_peaks(report.phases),
            "replayed_peaks": None if baseline is None else phase_peaks(baseline.phases),
            "advice": advice_rows(report.advice),
        }
        write_record(out / f"rank{rank}.json", record)
    write_record(out / f"training{rank}.json", sharded_training(losses, model, optimizer))
    dist.destroy_process_group()


if __name__ == "__main__":
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    start_ranks(run_rank, (find_free_network_port(), Path(sys.argv[1]), sys.argv[2:]), WORLD_SIZE)
