"""A hostile DeepSpeed ZeRO-3 loop on two gloo ranks, with and without the monitor replaying each rank's step.

Run by tests/hostile/test_live_sharded_steps.py: ``python zero3_hostile_train.py PORT OUT_DIR CASE [no-monitor]``.

A plain loop driving :class:`~lightning_vram.VramSession` (step 1 sampled, replays on) trains an MLP of one hidden
layer (``Linear(128, 128)``, ReLU, dropout, ``Linear(128, 10)``) 2 steps under ``deepspeed.initialize`` (ZeRO-3, the
settings of tests/zero_fsdp1_ranks.py). The step draws noise from a generator of the user's and
branches on ``torch.distributed.get_rank()``; a forward hook and a full backward hook of the user's count their
calls in a global. ``CASE`` ``plain``: that step; ``partition``: it also reads the
first layer's weight's ``ds_numel`` (ZeRO-3's attribute, which the replay's whole copy of the parameter lacks).
Rank ``r`` writes ``run<r>.json``: each step's loss, the final parameters (gathered whole), every RNG's state
(torch's, the user's generator, Python's), the call counts, the process groups left in ``torch.distributed`` and,
with the monitor, the simulation's skip reason and the monitor's warnings.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent.parent))
from forked_ranks import start_ranks
from training_records import groups_left, monitor_warnings, parameters_hex, rng_states, write_record
from zero_fsdp1_ranks import ZERO_SETTINGS

from lightning_vram import VramMonitorWarning, VramSession

STEPS, BATCH, WIDTH = 2, 64, 128
CALLS = {"forward hook": 0, "backward hook": 0}
"""The hooks' calls, counted in a module's global (the replay must leave it as training left it)."""
NOISE = torch.Generator()
"""The user's generator, drawn from in the step."""


def forward_hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
    CALLS["forward hook"] += 1


def backward_hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
    CALLS["backward hook"] += 1


def step_of(case: str) -> Any:
    """The step's loss function for ``case``."""

    def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        inputs = inputs + 0.01 * torch.rand(inputs.shape, generator=NOISE)
        if dist.get_rank() == 1:
            inputs = inputs * 2
        if case == "partition":
            network = getattr(module, "module", module)  # the engine's module, or the replay's copy
            inputs = inputs * (network[0].weight.ds_numel > 0)
        return nn.functional.cross_entropy(module(inputs), targets)

    return loss_of


def train(rank: int, out: Path, case: str, monitored: bool) -> None:
    import deepspeed  # type: ignore[import-untyped]

    torch.manual_seed(0)
    random.seed(0)
    NOISE.manual_seed(1)
    # One hidden layer: the parameters ZeRO-3 keeps gathered from forward to backward weigh in the rank's peaks.
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.25), nn.Linear(WIDTH, 10))
    model[0].register_forward_hook(forward_hook)
    model[-1].register_full_backward_hook(backward_hook)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, **ZERO_SETTINGS},
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    session = VramSession(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    loss_of = step_of(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", VramMonitorWarning)
        if monitored:
            session.start(
                model,
                [zero],
                device=torch.device("cpu"),
                rank=rank,
                world_size=2,
                step_function=loss_of,
                wrapper=lambda: engine,
            )
        data = torch.Generator().manual_seed(rank)
        losses = []
        for index in range(STEPS):
            batch = (torch.randn(BATCH, WIDTH, generator=data), torch.randint(0, 10, (BATCH,), generator=data))
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
    simulation = session.simulation
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        parameters = parameters_hex(model)
    record = {
        "losses": losses,
        "parameters": parameters,
        **rng_states(NOISE),
        "calls": dict(CALLS),
        **groups_left(),
        "skipped": None if simulation is None else simulation.skipped,
        "warnings": monitor_warnings(caught),
    }
    write_record(out / f"run{rank}.json", record)


def run_rank(rank: int, port: int, out: Path, case: str, monitored: bool) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")  # DeepSpeed reads these
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    train(rank, out, case, monitored)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, directory, which = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    start_ranks(run_rank, (port, directory, which, "no-monitor" not in sys.argv[4:]), 2, ("deepspeed",))
