"""A hostile live FSDP2 run on two gloo ranks, with and without the monitor replaying each rank's step.

Run by tests/hostile/test_live_sharded_steps.py: ``python fsdp2_hostile_train.py OUT_DIR CASE [no-monitor]``.

Lightning's ``ModelParallelStrategy`` (data parallel 2). ``CASE`` ``reads``: a step that reads what a sharded run
holds and runs no collective of the run's: the module's device mesh, a parameter's ``full_tensor()`` and
``to_local()``, a DTensor attribute, ``torch.distributed.get_rank()`` to branch, dropout, a generator of the user's,
a forward hook and a full backward hook counting calls, a step counter; units sharded three ways (the first linear
layer with ``reshard_after_forward=False``, the second in bfloat16 (``MixedPrecisionPolicy``), the last left to the
root). ``collectives``: the same step all-reducing a metric over its mesh's group (in a replay, the copy's mesh over
fake groups), then ``dist.barrier()`` on a group of the run's ranks it makes (``dist.new_group()``),
``self.all_gather`` and reading Lightning's mesh from ``self.trainer`` (a rank's replay stops at the new group).
``accumulate``: the ``reads`` step under ``accumulate_grad_batches=2`` (2 optimizer steps of 2 micro-batches), turning
FSDP2's gradient sync off on each window's first micro-batch (``set_requires_gradient_sync(batch_idx % 2 == 1)``);
the sampled step (2) is such a micro-batch.
Rank ``r`` writes ``run<r>.json``: each step's loss, its shards of the parameters and of the optimizer's state,
every RNG's state (torch's, the user's generator, Python's), the call counts, the process groups left in
``torch.distributed``, the monitor's warnings and, with the monitor, the simulation's skip reason and its
baseline's last note.
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

sys.path.insert(0, str(Path(__file__).parent.parent))
from advice_models import features
from forked_ranks import lightning_ranks
from models import loader
from training_records import groups_left, monitor_warnings, optimizer_hex, parameters_hex, rng_states, write_record

from lightning_vram import VramMonitor, VramMonitorWarning

WORLD_SIZE = 2
BATCH, WIDTH = 16, 32
CALLS = {"forward hook": 0, "backward hook": 0}
"""The hooks' calls, counted in a module's global (the replay must leave it as training left it)."""


class Hostile(LightningModule):
    """An MLP with dropout; its step reads the sharded run's objects (and with ``collectives`` talks to its ranks)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.network = nn.Sequential(
            nn.Linear(WIDTH, WIDTH),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(WIDTH, WIDTH),
            nn.ReLU(),
            nn.Linear(WIDTH, 10),
        )
        self.generator = torch.Generator().manual_seed(1)
        self.steps = 0
        self.seen: list[str] = []
        self.network[0].register_forward_hook(self.forward_hook)
        self.network[5].register_full_backward_hook(self.backward_hook)

    def forward_hook(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        CALLS["forward hook"] += 1

    def backward_hook(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        CALLS["backward hook"] += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        if self.case == "accumulate":
            self.network.set_requires_gradient_sync(batch_idx % 2 == 1)
        inputs, targets = batch
        inputs = inputs + 0.01 * torch.rand(inputs.shape, generator=self.generator)
        mesh = self.device_mesh
        weight = self.network[0].weight
        shard = weight.to_local()
        whole = weight.full_tensor()  # an all-gather over the unit's mesh
        scale = self.marker.to_local().sum() + whole.sum().detach() * 0 + shard.sum().detach() * 0
        self.seen.append(f"{mesh.mesh_dim_names} {self.device_mesh['data_parallel'].size()} {tuple(shard.shape)}")
        if dist.get_rank() == 1:
            inputs = inputs * 2
        loss = nn.functional.cross_entropy(self.network(inputs * scale), targets)
        if self.case == "collectives":
            metric = loss.detach().clone()
            dist.all_reduce(metric, group=mesh["data_parallel"].get_group())  # the replay's copy's mesh is fake
            dist.barrier(group=dist.new_group())  # a group of the run's ranks, made in the step
            gathered = self.all_gather(loss.detach())
            strategy = self.trainer.strategy.device_mesh.mesh_dim_names  # a replay does not attach the Trainer
            self.seen.append(f"{float(metric).hex()} {float(gathered.sum()).hex()} {strategy}")
        return loss

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        self.marker = distribute_tensor(torch.ones(()), mesh, [Replicate()])  # a DTensor the step reads
        fully_shard(self.network[0], mesh=mesh, reshard_after_forward=False)
        bfloat16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        fully_shard(self.network[3], mesh=mesh, mp_policy=bfloat16)
        fully_shard(self.network, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Training(Callback):
    """What training did on this rank (``training<r>.json``, at the end of fit, after the monitor's own hooks)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[str] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]).hex())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert isinstance(pl_module, Hostile)
        state = {
            "losses": self.losses,
            "parameters": parameters_hex(pl_module),
            "optimizer": optimizer_hex(trainer.optimizers[0]),
            **rng_states(pl_module.generator),
            "calls": dict(CALLS),
            "steps": pl_module.steps,
            "seen": pl_module.seen,
            **groups_left(),
        }
        write_record(self.out / f"training{trainer.global_rank}.json", state)


def main() -> None:
    out, case, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    callbacks: list[Callback] = [Training(out)] if mode == ["no-monitor"] else [monitor, Training(out)]
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1),
        max_steps=2 if case == "accumulate" else 4,
        accumulate_grad_batches=2 if case == "accumulate" else 1,
        logger=False,
        default_root_dir=out,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", VramMonitorWarning)
        trainer.fit(Hostile(case), loader(features(4 * BATCH * WORLD_SIZE, WIDTH), BATCH))
    record = json.loads((out / f"training{trainer.global_rank}.json").read_text())
    record["warnings"] = monitor_warnings(caught)
    simulation = monitor.session.simulation if mode != ["no-monitor"] else None
    record["skipped"] = None if simulation is None else simulation.skipped
    baseline = None if simulation is None else simulation.baseline
    record["note"] = None if baseline is None else baseline.notes[-1]
    write_record(out / f"run{trainer.global_rank}.json", record)


if __name__ == "__main__":
    lightning_ranks(main, WORLD_SIZE)
