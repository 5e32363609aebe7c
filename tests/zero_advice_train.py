"""DeepSpeed ZeRO-1/2 in a plain loop on WORLD CPU processes (gloo), each rank's replay and advice beside its step.

Run by tests/test_sharded_advice.py (its advice and its with-and-without training test):
``python tests/zero_advice_train.py WORLD PORT OUT_DIR STAGE [no-monitor] [bucket=ELEMENTS]``.
Each rank trains an MLP with LeakyReLU out of place (its advice: checkpointing, inplace activations) 3 steps under
``deepspeed.initialize`` (the ZeRO settings of tests/zero_fsdp1_ranks.py), a plain loop driving
:class:`~lightning_vram.VramSession` with replays on, step 1 sampled. Rank ``r`` writes ``rank<r>.json``: the
simulation's skip reason, its baseline match part by part, each advice's saving basis, saving and detail, the
report's peak and the stronger ZeRO stage predicted (``sharding``); and ``training<r>.json``: each step's loss, the
final parameters (ZeRO-3's gathered whole), the optimizer's state and the RNG's state. With
``no-monitor`` the same run trains without the session; ``bucket=ELEMENTS`` sets ``reduce_bucket_size``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from forked_ranks import start_ranks

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp
from replay_records import match_rows
from torch import nn
from training_records import torch_rng, write_record
from zero_fsdp1_ranks import ZERO_SETTINGS

from lightning_vram import VramSession
from lightning_vram.records.simulation_json import sharding_to_dict

STEPS = 3
BATCH, WIDTH = 64, 128


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    """The step's loss: cross-entropy of the MLP's logits."""
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs), targets)


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's numbers (one collective of the session's, outside any replay)."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, values)
    return rows


def train(rank: int, world: int, stage: int, monitored: bool, out: Path, bucket: int) -> None:
    import deepspeed  # type: ignore[import-untyped]

    torch.manual_seed(0)
    model = activation_mlp(nn.LeakyReLU, width=WIDTH)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, **ZERO_SETTINGS, "reduce_bucket_size": bucket},
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    session = VramSession(attribution_start_step=1, attribution_every_n_steps=1, console_summary=False)
    if monitored:
        session.start(
            model,
            [zero],
            device=torch.device("cpu"),
            rank=rank,
            world_size=world,
            gather=gather,
            step_function=loss_of,
            wrapper=lambda: engine,
        )
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for index in range(STEPS):
        batch = (torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        if monitored:
            session.batch_start(batch)
        loss = loss_of(engine, batch)
        if monitored:
            session.before_backward()
        engine.backward(loss)
        if monitored:
            session.before_optimizer_step()
        engine.step()
        if monitored:
            session.batch_end(index)
        losses.append(loss.item().hex())
    if monitored:
        report = session.finish(gather_ranks=False)
        simulation = session.simulation
        assert report is not None and simulation is not None
        match = simulation.match
        record = {
            "skipped": simulation.skipped,
            "match": match_rows(match),
            "advice": {
                advice.id: [str(advice.saving_basis), advice.estimated_saving_bytes] for advice in report.advice
            },
            "notes": list(simulation.baseline.notes) if simulation.baseline is not None else [],
            "details": {advice.id: advice.detail for advice in report.advice},
            "peak": None if report.peak is None else [report.peak.phase.value, report.peak.peak_bytes],
            "phases": {
                phase.value: [peak.peak_bytes, *(peak.breakdown.to_dict().values() if peak.breakdown else ())]
                for phase, peak in report.phases.items()
            },
            "sharding": sharding_to_dict(simulation.sharding),
        }
        write_record(out / f"rank{rank}.json", record)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):  # ZeRO-3's are partitioned
        parameters = {name: tensor.flatten().tolist() for name, tensor in model.named_parameters()}
    state = {
        "losses": losses,
        "parameters": parameters,
        "optimizer": repr(zero.optimizer.state_dict()) if stage < 3 else None,  # ZeRO-3's holds its flat partitions
        "master": [tensor.tolist() for tensor in getattr(zero, "single_partition_of_fp32_groups", ())],
        "rng": torch_rng(),
    }
    write_record(out / f"training{rank}.json", state)


def run_rank(rank: int, world: int, port: int, out: Path, stage: int, monitored: bool, bucket: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    train(rank, world, stage, monitored, out, bucket)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, port, directory, zero_stage = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    options = sys.argv[5:]
    buckets = [int(option.removeprefix("bucket=")) for option in options if option.startswith("bucket=")]
    reduce_bucket = buckets[0] if buckets else ZERO_SETTINGS["reduce_bucket_size"]
    arguments = (world_size, port, directory, zero_stage, "no-monitor" not in options, reduce_bucket)
    start_ranks(run_rank, arguments, world_size, ("deepspeed",))
