"""Two-process DDP on the CPU (gloo), run by tests/test_distributed.py: ``python tests/ddp_train.py OUT_DIR``.

Lightning starts the second rank by running this script again. Rank 1 doubles its batch inside the step, so the
ranks' memory differs and the reduction has something to show.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))
from models import Classifier, dataset_for, linear_net, loader

from lightning_vram import VramMonitor


class RankDependent(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        if self.global_rank == 1:
            inputs, targets = inputs.repeat(2, 1), targets.repeat(2)
        return super().training_step((inputs, targets), batch_idx)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    monitor = VramMonitor(log_every_n_steps=2, attribution_start_step=1, attribution_every_n_steps=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4,
        logger=CSVLogger(out, name="ddp"),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(RankDependent(linear_net()), loader(dataset_for("linear", samples=128)))
    assert monitor.report is not None
    (out / f"rank{trainer.global_rank}.steps").write_text(str(monitor.report.steps))


if __name__ == "__main__":
    main()
