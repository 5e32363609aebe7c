"""A live FSDP2 run under Fabric on two CPU ranks (gloo), each rank's replay beside its step.

Run by tests/test_fsdp2_live.py: ``python tests/fsdp2_fabric_train.py OUT_DIR [no-monitor]``. Fabric's
``ModelParallelStrategy`` (data parallel 2) shards the MLP of tests/fsdp2_live_train.py in its ``parallelize_fn``
(each linear layer, then the MLP); a plain loop drives :class:`~lightning_vram.VramSession` (no
``configure_optimizers``: the replay builds an Adam like the run's on its shards), 4 steps, step 2 sampled. Rank
``r`` writes ``rank<r>.json`` (the simulation's skip reason, notes, measured and replayed peaks, what gloo's thread
released late of each live peak, advice) and
``training<r>.json`` (losses, its shards of the parameters and of Adam's state, the RNG's state).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp
from forked_ranks import lightning_ranks
from fsdp2_live_train import BATCH, WIDTH, WORLD_SIZE
from replay_records import advice_rows, phase_peaks, released_late
from training_records import sharded_training, write_record

from lightning_vram import VramSession

STEPS = 4


def parallelize(network: nn.Module, mesh: Any) -> nn.Module:
    """Each linear layer, then the whole, an FSDP2 unit over the data-parallel mesh."""
    for layer in network:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(network, mesh=mesh["data_parallel"])
    return network


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs), targets)


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's numbers (one collective of the session's, outside any replay)."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, values)
    return rows


def main() -> None:
    out, monitored = Path(sys.argv[1]), sys.argv[2:] != ["no-monitor"]
    torch.set_num_threads(1)
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=WORLD_SIZE, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    network = activation_mlp(nn.LeakyReLU, width=WIDTH)
    model = fabric.setup(network)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(network.parameters(), lr=1e-3))
    rank = fabric.global_rank
    session = VramSession(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    if monitored:
        session.start(
            network,
            [optimizer],
            device=torch.device("cpu"),
            rank=rank,
            world_size=WORLD_SIZE,
            gather=gather,
            step_function=loss_of,
            wrapper=lambda: model,
        )
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for index in range(STEPS):
        batch = (torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        if monitored:
            session.batch_start(batch)
        loss = loss_of(model, batch)
        if monitored:
            session.before_backward()
        fabric.backward(loss)
        if monitored:
            session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        if monitored:
            session.batch_end(index)
        losses.append(loss.item().hex())
    if monitored:
        report = session.finish(gather_ranks=False)
        simulation = session.simulation
        assert report is not None and simulation is not None
        baseline = simulation.baseline
        record = {
            "skipped": simulation.skipped,
            "notes": [] if baseline is None else list(baseline.notes),
            "measured_peaks": phase_peaks(report.phases),
            "replayed_peaks": None if baseline is None else phase_peaks(baseline.phases),
            "released_late": released_late(simulation.match),
            "advice": advice_rows(report.advice),
        }
        write_record(out / f"rank{rank}.json", record)
    write_record(out / f"training{rank}.json", sharded_training(losses, network, optimizer))


if __name__ == "__main__":
    lightning_ranks(main, WORLD_SIZE)
