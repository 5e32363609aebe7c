"""Two-process DDP on the CPU (gloo): ``python tests/ddp_train.py OUT_DIR STRATEGY [peer-fails]``, run by
test_distributed.py.

With ``ddp`` Lightning starts the second rank by running this script again; with ``ddp_spawn`` it spawns both.
Rank 1 doubles its batch inside the step, so the ranks' memory differs and the reduction has something to show.
With ``peer-fails``, rank 1 raises at train end before its monitor's hook, and its process ends; each rank writes
how its fit ended to ``rankN.outcome`` and the monitor's warnings to ``rankN.warnings``. With ``ddp_spawn`` the
process that called fit (no rank) writes what its monitor holds after fit to ``after_fit.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))
from models import Classifier, dataset_for, linear_net, loader

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.codec import report_to_dict


class RankDependent(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        if self.global_rank == 1:
            inputs, targets = inputs.repeat(2, 1), targets.repeat(2)
        return super().training_step((inputs, targets), batch_idx)


class RecordSteps(Callback):
    """After the monitor's own train-end hook, in each rank's process: how many steps its report covers."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (monitor,) = (callback for callback in trainer.callbacks if isinstance(callback, VramMonitor))  # type: ignore[attr-defined]
        assert monitor.report is not None
        (self.out / f"rank{trainer.global_rank}.steps").write_text(str(monitor.report.steps))


class PeerFails(Callback):
    """Rank 1 raises at train end, before the monitor's own hook: rank 0's monitor then gathers from a rank gone."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank == 1:
            raise RuntimeError("rank 1 fails at train end")


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    peer_fails = sys.argv[3:] == ["peer-fails"]
    torch.set_num_threads(1)
    monitor = VramMonitor(log_every_n_steps=2, attribution_start_step=1, attribution_every_n_steps=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        logger=CSVLogger(out, name="ddp"),
        callbacks=[*([PeerFails()] if peer_fails else []), monitor, RecordSteps(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", VramMonitorWarning)
        try:
            trainer.fit(RankDependent(linear_net()), loader(dataset_for("linear", samples=128)))
        except BaseException as error:
            (out / f"rank{trainer.global_rank}.outcome").write_text(f"{type(error).__name__}: {error}")
            raise
        finally:
            ours = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
            (out / f"rank{trainer.global_rank}.warnings").write_text(json.dumps(ours))
    (out / f"rank{trainer.global_rank}.outcome").write_text("finished")
    if strategy == "ddp_spawn":  # only the process that called fit runs this: the ranks were spawned
        report, path = monitor.report, monitor.report_path
        after_fit = {
            "report": report_to_dict(report) if report is not None else None,
            "report_path": str(path) if path is not None else None,
        }
        (out / "after_fit.json").write_text(json.dumps(after_fit))


if __name__ == "__main__":
    main()
