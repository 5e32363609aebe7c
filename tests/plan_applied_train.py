"""A plan's row applied: the README's quickstart trained on gloo ranks as the row says, run by test_plan_applied.py:
``python tests/plan_applied_train.py OUT_DIR WORLD_SIZE MICRO_BATCH ACCUMULATION PRECISION``.

The quickstart's ``SmallCNN`` under Lightning's ``ddp`` on the CPU, 4 optimizer steps, steps 2 and 3 sampled by the
monitor. Rank ``r`` writes ``rank<r>.json``: each phase's measured peak (the live peak of the sampled steps) and
its counted parts, bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from forked_ranks import lightning_ranks
from quickstart import SmallCNN, synthetic_images
from torch.utils.data import DataLoader

from lightning_vram import VramMonitor


class Record(Callback):
    """After the monitor's own hooks: each phase's measured peak and parts on this rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (monitor,) = (callback for callback in trainer.callbacks if isinstance(callback, VramMonitor))  # type: ignore[attr-defined]
        report = monitor.report
        assert report is not None
        phases = {
            phase.value: {
                "peak": peak.peak_bytes,
                "parts": None if peak.breakdown is None else peak.breakdown.to_dict(),
            }
            for phase, peak in report.phases.items()
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"phases": phases}))


def main() -> None:
    out, world_size, micro, accumulation, precision = Path(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=1, console_summary=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        precision=precision,  # type: ignore[arg-type]
        accumulate_grad_batches=accumulation,
        max_steps=4,
        logger=False,
        default_root_dir=out,
        callbacks=[monitor, Record(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    images = synthetic_images(4 * micro * accumulation * world_size)
    trainer.fit(SmallCNN(), DataLoader(images, batch_size=micro, shuffle=False, drop_last=True))


if __name__ == "__main__":
    lightning_ranks(main, int(sys.argv[2]))
