"""DDP on the CPU (gloo), each rank's replay beside its measured step, run by test_distributed_replay.py:
``python tests/ddp_replay_train.py OUT_DIR WORLD_SIZE STRATEGY [rank1-skips | no-monitor]``.

An MLP with LeakyReLU out of place (its advice: checkpointing, inplace activations), rank 1 doubling its batch
inside the step, 4 steps, steps 2 and 3 sampled. Rank ``r`` writes ``rank<r>.json``: the monitor's measured phase
peaks and counted parts of the sampled step its replay was checked against (``simulation.match``), each phase's
measured peak in its report, the replay's phases, the strategy's line, DDP's own buckets (read from its Reducer at
train end), the advice (with its titles, savings and what was not advised) and the rank predicted under ZeRO-2 and
FSDP (``sharding``); ``training<r>.json`` what training did. With ``rank1-skips`` rank 1 reads its loss's
value in its step instead (a replay cannot), so rank 1 skips the replay that rank 0 runs; with ``no-monitor`` the
same run trains without the monitor.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp, features
from forked_ranks import lightning_ranks
from models import Classifier, loader
from training_records import torch_rng, write_record

from lightning_vram import VramMonitor
from lightning_vram.records.simulation_json import sharding_to_dict

BATCH = 512
SMALL_BATCH = 8
"""The batch with ``small-batch``: parameters, gradients and Adam's state outweigh the activations."""
WIDTH = 256


class RankOneDiffers(Classifier):
    """Rank 1 doubles its batch inside the step, so the ranks' steps differ (a replay's copy knows its rank); with
    ``skips_on=1`` it reads its loss's value instead (a replay cannot)."""

    skips_on: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        if self.global_rank == 1 and self.skips_on is None:
            inputs, targets = inputs.repeat(2, 1), targets.repeat(2)
        loss = super().training_step((inputs, targets), batch_idx)
        if self.skips_on == self.global_rank:
            self.last_loss = float(loss)
        return loss


class Record(Callback):
    """After the monitor's own hooks, in each rank's process: what it measured and what its replay predicted."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (monitor,) = (callback for callback in trainer.callbacks if isinstance(callback, VramMonitor))  # type: ignore[attr-defined]
        report, simulation = monitor.report, monitor.session.simulation
        assert report is not None and simulation is not None
        baseline, match = simulation.baseline, simulation.match
        ddp = trainer.strategy.model
        record = {
            "rank": trainer.global_rank,
            "skipped": simulation.skipped,
            "match": None
            if match is None
            else [[part.phase.value, part.part, part.measured_bytes, part.replayed_bytes] for part in match.parts],
            "measured_peaks": {phase.value: peak.peak_bytes for phase, peak in report.phases.items()},
            "replayed_peaks": None
            if baseline is None
            else {phase.value: peak.peak_bytes for phase, peak in baseline.phases.items()},
            "strategy": None
            if baseline is None or baseline.strategy is None
            else {"label": baseline.strategy.label, "buffers": list(baseline.strategy.buffers)},
            "reducer_buckets": [
                bucket.buffer().untyped_storage().nbytes() for bucket in ddp.reducer._get_zeros_like_grad_buckets()
            ],
            "gradient_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad),
            "advice": [[advice.id, advice.saving_basis] for advice in report.advice],
            "titles": {advice.id: advice.title for advice in report.advice},
            "savings": {advice.id: advice.estimated_saving_bytes for advice in report.advice},
            "not_advised": {item.id: item.reason for item in report.not_advised},
            "sharding": sharding_to_dict(simulation.sharding),
        }
        write_record(self.out / f"rank{trainer.global_rank}.json", record)


class Training(Callback):
    """What training did on this rank, to compare with and without the monitor: each step's loss, the final
    parameters and optimizer state, the random number generator's state (``training<r>.json``)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state = {
            "losses": [value.hex() for value in self.losses],
            "parameters": {name: tensor.flatten().tolist() for name, tensor in pl_module.state_dict().items()},
            "optimizer": repr(trainer.optimizers[0].state_dict()),
            "rng": torch_rng(),
        }
        write_record(self.out / f"training{trainer.global_rank}.json", state)


def main() -> None:
    out, world_size, strategy = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    monitored = sys.argv[4:] != ["no-monitor"]
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=1, console_summary=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=4,
        logger=False,
        default_root_dir=out,
        callbacks=[monitor, Record(out), Training(out)] if monitored else [Training(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = RankOneDiffers(activation_mlp(nn.LeakyReLU, width=WIDTH))
    module.skips_on = 1 if sys.argv[4:] == ["rank1-skips"] else None
    batch = SMALL_BATCH if sys.argv[4:] == ["small-batch"] else BATCH
    trainer.fit(module, loader(features(4 * batch * world_size, WIDTH), batch))


if __name__ == "__main__":
    if sys.argv[3] == "ddp":  # ddp_spawn's runs start their ranks as Lightning does
        lightning_ranks(main, int(sys.argv[2]))
    else:
        main()
