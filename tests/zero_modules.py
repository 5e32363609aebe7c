"""LightningModules users train, each building its own optimizer: tests/zero_module_optimizer_train.py's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn


class Block(nn.Module):
    """A residual block: two 3x3 convolutions with BatchNorm."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetSGD(LightningModule):
    """A ResNet-style classifier (a stem, two residual blocks of 32 channels, a head) under SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.layers = nn.Sequential(Block(32), Block(32))
        self.head = nn.Linear(32, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.head(self.layers(self.stem(images)).mean((2, 3))), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TransformerAdamW(LightningModule):
    """A transformer LM (embedding of 1,000 tokens, 2 encoder layers of width 64, a head) under AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 1000)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.head(self.encoder(self.embed(ids[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


MODULES: dict[str, Callable[[], LightningModule]] = {"resnet": ResNetSGD, "transformer": TransformerAdamW}


def batch_of(name: str, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """One rank's batch for the module ``name``: 16 images of 16 x 16, or 8 sequences of 33 tokens."""
    if name == "resnet":
        return torch.randn(16, 3, 16, 16, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    return (torch.randint(0, 1000, (8, 33), generator=generator),)
