"""The monitor's own Python work per training step, with the scripted probe standing in for CUDA.

A real Trainer trains a tiny model on the CPU for many steps; VramMonitor reads a
:class:`~lightning_vram.testing.ScriptedProbe` (so the CUDA code path runs: allocator reads at every phase
boundary, phase peaks, the tracker), and every hook of the monitor is wrapped in a timer. Prints the time spent
inside the monitor's hooks per step, as the mean over the ordinary steps of a round: step 0 (the preflight replay,
once per run) and the one sampled step (counted tensor by tensor and replayed, as with
``attribution_every_n_steps=None``, so every later step attributes its peak to the sampled counts) are left out;
``benchmarks/replay_cost.py`` prices those. Median over rounds, with the range. Logging runs at Lightning's default
interval of 50 steps, so its work is amortised as in a real run.

    python benchmarks/hot_path.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
)
"""The monitor's hooks that run during training steps and epochs."""


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


SAMPLED_STEP = 2


def timed(method: Callable[..., Any], per_step: list[float], starts_step: bool) -> Callable[..., Any]:
    """``method``, adding the seconds it takes to the last entry of ``per_step`` (a new entry if ``starts_step``)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if starts_step:
            per_step.append(0.0)
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            if per_step:
                per_step[-1] += time.perf_counter() - start

    return wrapper


def one_round(steps: int) -> float:
    """Mean seconds spent inside the monitor's hooks per ordinary training step, over one fit of ``steps`` steps."""
    boundaries = [
        ScriptedBoundary(allocated_bytes=1000 + 10 * i, reserved_bytes=4096, highest_bytes=1500 + 10 * i)
        for i in range(4)
    ]
    monitor = VramMonitor(
        attribution_start_step=SAMPLED_STEP,
        attribution_every_n_steps=None,
        console_summary=False,
        probe=ScriptedProbe(boundaries),
    )
    per_step: list[float] = []
    for name in HOOKS:
        setattr(monitor, name, timed(getattr(monitor, name), per_step, starts_step=name == "on_train_batch_start"))
    data = TensorDataset(torch.randn(steps, 4), torch.randint(0, 2, (steps,)))
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            logger=CSVLogger(root),
            callbacks=[monitor],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=root,
        )
        trainer.fit(Tiny(), DataLoader(data, batch_size=1))
    ordinary = per_step[1:SAMPLED_STEP] + per_step[SAMPLED_STEP + 1 :]
    return statistics.fmean(ordinary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    one_round(200)  # warm-up: imports, first-call costs
    per_step = [one_round(arguments.steps) for _ in range(arguments.rounds)]
    micro = [1e6 * seconds for seconds in per_step]
    print(
        f"monitor's own work per step (scripted CUDA probe, {arguments.steps} steps x {arguments.rounds} rounds):"
        f" median {statistics.median(micro):.1f} us [range {min(micro):.1f} - {max(micro):.1f}]"
    )


if __name__ == "__main__":
    main()
