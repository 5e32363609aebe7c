"""Preflight on each DeepSpeed ZeRO rank in a plain loop on 2 CPU processes (gloo), run by test_preflight_ranks.py:
``python tests/preflight_zero_train.py PORT OUT_DIR FREE_BYTES``.

The MLP, optimizer and ZeRO settings of tests/zero_advice_train.py, 2 steps; rank ``r`` trains on batches of
``BATCH * (r + 1)`` samples, so rank 1's step needs more. Each rank's session reads a
:class:`~lightning_vram.testing.ScriptedProbe` whose device has ``FREE_BYTES`` free; the session's gather is
``all_gather_object``. In one process start (one DeepSpeed import) each rank trains four times: ZeRO-2 with the
session, ZeRO-2 without it, ZeRO-3 with it and without it. For each, named ``zero2``, ``bare2``, ``zero3``,
``bare3``, rank ``r`` writes
``<name>-training<r>.json`` (what training did, to compare with and without) and, with the session,
``<name>-preflight<r>.json`` (the rows the ranks agreed on, its own verdict and how it was predicted, the monitor's
warnings).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from preflight_records import preflight_record

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp
from torch import nn
from training_records import torch_rng, write_record
from zero_advice_train import BATCH, WIDTH, gather, loss_of
from zero_fsdp1_ranks import ZERO_SETTINGS

from lightning_vram import VramMonitorWarning, VramSession
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

WORLD = 2
STEPS = 2


def train(rank: int, stage: int, free_bytes: int, monitored: bool, out: Path) -> None:
    """Train ``STEPS`` steps under ZeRO-``stage`` (with the session when ``monitored``) and write what it did."""
    import deepspeed  # type: ignore[import-untyped]

    name = f"zero{stage}" if monitored else f"bare{stage}"
    torch.manual_seed(0)
    model = activation_mlp(nn.LeakyReLU, width=WIDTH)
    batch_size = BATCH * (rank + 1)
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, **ZERO_SETTINGS},
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], free_bytes=free_bytes)
    session = VramSession(probe=probe, attribution_start_step=100, console_summary=False)
    if monitored:
        session.start(
            model,
            [zero],
            device=torch.device("cpu"),
            rank=rank,
            world_size=WORLD,
            gather=gather,
            step_function=loss_of,
            wrapper=lambda: engine,
        )
    generator = torch.Generator().manual_seed(rank)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", VramMonitorWarning)
        for index in range(STEPS):
            inputs = torch.randn(batch_size, WIDTH, generator=generator)
            batch = (inputs, torch.randint(0, 10, (batch_size,), generator=generator))
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
        session.finish(gather_ranks=False)
        record = preflight_record(session, caught)
        write_record(out / f"{name}-preflight{rank}.json", record)
    state = {
        "losses": losses,
        "parameters": {key: tensor.flatten().tolist() for key, tensor in model.state_dict().items()},
        "optimizer": repr(zero.optimizer.state_dict()) if stage < 3 else None,  # ZeRO-3's is keyed by its partitions
        "state": [
            {key: value.tolist() for key, value in state.items()} for state in zero.optimizer.state.values()
        ],  # the user's optimizer's state (ZeRO-3: over its flat partitions)
        "partitions": [parameter.ds_tensor.tolist() for parameter in model.parameters() if stage == 3],
        "master": [tensor.tolist() for tensor in getattr(zero, "fp32_partitioned_groups_flat", ())],
        "rng": torch_rng(),
    }
    write_record(out / f"{name}-training{rank}.json", state)


def run_rank(rank: int, port: int, out: Path, free_bytes: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    for stage, monitored in ((2, True), (2, False), (3, True), (3, False)):
        train(rank, stage, free_bytes, monitored, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, directory, free = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    start_ranks(run_rank, (port, directory, free), WORLD, ("deepspeed",))
