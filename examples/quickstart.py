"""Quickstart: a small CNN on synthetic images with VramMonitor and a TensorBoardLogger.

Runs on a CUDA GPU when there is one, else on the CPU; nothing is downloaded.

    python examples/quickstart.py                 # writes runs/quickstart/version_N/
    tensorboard --logdir runs/quickstart
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor


class SmallCNN(pl.LightningModule):
    """Two conv blocks and a linear head for 10 classes of 3x32x32 images."""

    def __init__(self, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(64 * 8 * 8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(images).flatten(1))
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)


def synthetic_images(samples: int, seed: int = 0) -> TensorDataset:
    """Random 3x32x32 images with random labels: a stand-in for a real image set."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60, help="training batches to run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--root-dir", default="runs", help="where logs and the report go")
    arguments = parser.parse_args()

    torch.manual_seed(0)
    loader = DataLoader(synthetic_images(arguments.batch_size * 16), batch_size=arguments.batch_size, shuffle=True)
    monitor = VramMonitor(attribution_every_n_steps=20)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=arguments.max_steps,
        log_every_n_steps=10,  # 16 batches an epoch: Lightning's default of 50 would log nothing (and warn)
        logger=TensorBoardLogger(arguments.root_dir, name="quickstart"),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SmallCNN(), loader)
    assert monitor.report is not None, "fit ended without a report"
    print(json.dumps(monitor.report.to_dict()["peak"], indent=2))  # the console summary said where the files are


if __name__ == "__main__":
    main()
