"""Step-time overhead of VramMonitor against a bare run and Lightning's DeviceStatsMonitor.

Beside them a run with an empty callback (one that overrides nothing): what Lightning's dispatch of the hooks costs any
callback, and how far apart two runs that differ by nothing measurable land on this machine.

The four configurations run interleaved in one process: every round runs each once, in a rotating
order, after one unrecorded warm-up round. Every step is timed from one ``on_train_batch_start`` to the
next by the same tiny callback in all of them. Prints each configuration's median step time and its
ratio to the bare run of the same round (median over rounds, with the range), so slow drifts of the
machine cancel out.

    python benchmarks/overhead.py                      # small CPU MLP, a 1-2 ms step
    python benchmarks/overhead.py --accelerator gpu    # the same on a CUDA GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor


class StepClock(pl.Callback):
    """Records the time between consecutive training-batch starts, in seconds."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.append(now - self._last)
        self._last = now


class Mlp(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self.network(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


CONFIGURATIONS: dict[str, Callable[[], list[pl.Callback]]] = {
    "bare": lambda: [],
    "EmptyCallback": lambda: [pl.Callback()],
    "DeviceStatsMonitor": lambda: [DeviceStatsMonitor()],
    "VramMonitor": lambda: [VramMonitor(console_summary=False)],
}


def run_once(name: str, arguments: argparse.Namespace, root: str) -> list[float]:
    torch.manual_seed(0)
    data = TensorDataset(
        torch.randn(arguments.batch_size * 64, arguments.width), torch.randint(0, 10, (arguments.batch_size * 64,))
    )
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator=arguments.accelerator,
        devices=1,
        max_steps=arguments.steps,
        logger=CSVLogger(root, name=name),
        log_every_n_steps=arguments.log_every_n_steps,
        callbacks=[clock, *CONFIGURATIONS[name]()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Mlp(arguments.width), DataLoader(data, batch_size=arguments.batch_size, shuffle=True))
    return clock.step_seconds[arguments.warmup :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=200, help="training batches per run")
    parser.add_argument("--warmup", type=int, default=20, help="first step times of each run to drop")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds; each runs every configuration once")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every-n-steps", type=int, default=50, help="the Trainer's (Lightning's default: 50)")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice on this deliberately small set-up is not the point here

    names = list(CONFIGURATIONS)
    medians: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as root:
        for name in names:  # one unrecorded round: imports, allocator and thread-pool warm-up
            run_once(name, arguments, root)
        for round_index in range(arguments.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]  # rotate the order
            for name in order:
                medians[name].append(statistics.median(run_once(name, arguments, root)))

    device = torch.cuda.get_device_name() if arguments.accelerator in ("gpu", "cuda") else "cpu"
    print(f"device: {device}; torch {torch.__version__}; lightning {lightning.__version__}")
    print(
        f"{arguments.rounds} interleaved rounds x {arguments.steps - arguments.warmup} timed steps per configuration;"
        f" log_every_n_steps={arguments.log_every_n_steps}; ratios are per round (adjacent runs), median [min, max]"
    )
    print(f"{'configuration':<20} {'median step':>12} {'ratio to bare':>26}")
    for name in names:
        ratios = [run / bare for run, bare in zip(medians[name], medians["bare"], strict=True)]
        print(
            f"{name:<20} {1000 * statistics.median(medians[name]):>9.3f} ms"
            f" {statistics.median(ratios):>10.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        )
    paired = [vram / stats for vram, stats in zip(medians["VramMonitor"], medians["DeviceStatsMonitor"], strict=True)]
    print(f"VramMonitor / DeviceStatsMonitor: {statistics.median(paired):.3f} [{min(paired):.3f}, {max(paired):.3f}]")


if __name__ == "__main__":
    main()
