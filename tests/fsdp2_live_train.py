"""A live FSDP2 run on two CPU ranks (gloo), each rank's replay and advice beside its step.

Run by tests/test_fsdp2_live.py: ``python tests/fsdp2_live_train.py OUT_DIR [no-monitor | preflight=FREE_BYTES]
[offload] [root-self]``.

Lightning's ``ModelParallelStrategy`` (data parallel 2, tensor parallel 1): the module's ``configure_model`` calls
``fully_shard`` on each linear layer of an MLP with LeakyReLU out of place, then on the MLP (its advice:
checkpointing, inplace activations). Adam, 4 steps, step 2 sampled, replays on. Rank ``r`` writes ``rank<r>.json``:
the simulation's skip reason, its baseline's notes, the match part by part, what gloo's thread released late of each
live peak, the measured and replayed peaks per phase, each advice's id, saving basis, saving and detail; and
``training<r>.json``: each step's loss, the rank's shards of the final parameters and of the optimizer's state, and
the RNG's state. With ``no-monitor`` the same run
trains without the monitor. With ``preflight=FREE_BYTES`` each rank's monitor reads a scripted CUDA device with that
many bytes free (``ScriptedProbe``) and rank ``r`` writes ``preflight<r>.json`` instead: the rows the ranks agreed
on, its own verdict and the monitor's warnings. With ``offload`` every unit is sharded with
``CPUOffloadPolicy(pin_memory=False)``. With ``root-self`` the root unit is the LightningModule itself
(``fully_shard(self)``, as the plan's printed ``configure_model`` shards a module whose step calls ``self``), not
the MLP, and the step calls ``self``. With ``wide-head`` the module is tests/rank_prediction_train.py's
``WideHead`` under the plan's printed ``configure_model`` (its root unit's reduce-scatter, the largest, at backward's
peak: gloo's copy of its input counts there), 8 samples of width 32 a step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp, features
from forked_ranks import lightning_ranks
from models import loader
from preflight_records import preflight_record
from replay_records import advice_rows, match_rows, phase_peaks, released_late
from training_records import sharded_training, write_record

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

WORLD_SIZE = 2
BATCH, WIDTH = 64, 128


class ShardedMLP(LightningModule):
    """The MLP, each linear layer and then the whole an FSDP2 unit (offloaded to the CPU with ``offload``); Adam."""

    def __init__(self, offload: bool = False, root_self: bool = False) -> None:
        super().__init__()
        self.network = activation_mlp(nn.LeakyReLU, width=WIDTH)
        self.offload = offload
        self.root_self = root_self

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy((self if self.root_self else self.network)(inputs), targets)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.network(inputs)  # type: ignore[no-any-return]

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        policy = CPUOffloadPolicy(pin_memory=False) if self.offload else OffloadPolicy()
        for layer in self.network:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(self if self.root_self else self.network, mesh=mesh, offload_policy=policy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Training(Callback):
    """What training did on this rank: each step's loss, its shards of the parameters and state, the RNG's state."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[str] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]).hex())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = sharded_training(self.losses, pl_module, trainer.optimizers[0])
        write_record(self.out / f"training{trainer.global_rank}.json", record)


class Record(Callback):
    """After the monitor's own hooks, in each rank's process: what it measured, what its replay predicted."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (monitor,) = (callback for callback in trainer.callbacks if isinstance(callback, VramMonitor))  # type: ignore[attr-defined]
        report, simulation = monitor.report, monitor.session.simulation
        assert report is not None and simulation is not None
        baseline, match = simulation.baseline, simulation.match
        record = {
            "skipped": simulation.skipped,
            "notes": [] if baseline is None else list(baseline.notes),
            "match": match_rows(match),
            "released_late": released_late(match),
            "measured_peaks": phase_peaks(report.phases),
            "replayed_peaks": None if baseline is None else phase_peaks(baseline.phases),
            "advice": advice_rows(report.advice),
        }
        write_record(self.out / f"rank{trainer.global_rank}.json", record)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    monitored = "no-monitor" not in mode
    free = [int(option.removeprefix("preflight=")) for option in mode if option.startswith("preflight=")]
    if free:
        probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], free_bytes=free[0])
        monitor = VramMonitor(probe=probe, attribution_start_step=100, console_summary=False)
        callbacks: list[Callback] = [monitor]
    else:
        monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
        callbacks = [monitor, Record(out), Training(out)] if monitored else [Training(out)]
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1),
        max_steps=4,
        logger=False,
        default_root_dir=out,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", VramMonitorWarning)
        if "wide-head" in mode:
            from rank_prediction_train import WideHead, printed_code_applied

            trainer.fit(printed_code_applied(WideHead()), loader(features(4 * 8 * WORLD_SIZE, 32), 8))
        else:
            module = ShardedMLP("offload" in mode, "root-self" in mode)
            trainer.fit(module, loader(features(4 * BATCH * WORLD_SIZE, WIDTH), BATCH))
    if free:
        session = monitor.session
        record = preflight_record(session, caught)
        write_record(out / f"preflight{trainer.global_rank}.json", record)


if __name__ == "__main__":
    lightning_ranks(main, WORLD_SIZE)
