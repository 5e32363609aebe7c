"""Real architectures for the replay tests (a ResNet-style CNN, a transformer encoder, an LSTM, an MLP, a GPT-2-class
language model), and a helper that trains one with the monitor and returns its counted step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from models import (
    OPTIMIZERS,
    REPLAYS_OFF,
    BasicBlock,
    Classifier,
    LastStep,
    MeanOverTime,
    OptimizerFactory,
    loader,
    trainer,
)
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.records import Attribution


def resnet(channels: int = 16, blocks: int = 2) -> nn.Module:
    """A ResNet-style stem (conv, BatchNorm, inplace ReLU), ``blocks`` basic blocks, pooling and a classifier."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        nn.Sequential(*(BasicBlock(channels) for _ in range(blocks))),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )


def encoder(width: int = 32, layers: int = 2) -> nn.Module:
    """``layers`` nn.TransformerEncoderLayer(width, 4 heads), mean-pooled over time, and a classifier."""
    layer = nn.TransformerEncoderLayer(d_model=width, nhead=4, dim_feedforward=2 * width, batch_first=True)
    stack = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    return nn.Sequential(stack, MeanOverTime(), nn.Linear(width, 10))


def lstm(width: int = 32) -> nn.Module:
    """Embedding(100, width) + a two-layer LSTM + a classifier on the last time step."""
    recurrent = nn.LSTM(width, width, num_layers=2, batch_first=True)
    return nn.Sequential(nn.Embedding(100, width), recurrent, LastStep(), nn.Linear(width, 10))


def mlp(width: int = 64, depth: int = 3) -> nn.Module:
    """``depth`` Linear + out-of-place ReLU pairs and a classifier."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class CausalLM(pl.LightningModule):
    """A GPT-2-class language model from transformers' config classes (random weights, nothing downloaded)."""

    def __init__(self, optimizer: OptimizerFactory = OPTIMIZERS["adamw"], layers: int = 2, vocab: int = 1000) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=layers, n_embd=64, n_head=2, vocab_size=vocab, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)
        self.optimizer_factory = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss: torch.Tensor = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


@dataclass(frozen=True)
class Architecture:
    """A model to build, its data, and how large its batches are."""

    build: Callable[[], pl.LightningModule]
    data: Callable[[int], Dataset[Any]]
    batch_size: int


def images(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 3, 16, 16, generator=generator), torch.randint(0, 10, (samples,)))


def sequences(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 12, 32, generator=generator), torch.randint(0, 10, (samples,)))


def tokens(samples: int, vocab: int = 100, length: int = 12) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randint(0, vocab, (samples, length), generator=generator), torch.randint(0, 10, (samples,))
    )


def vectors(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 64, generator=generator), torch.randint(0, 10, (samples,)))


def text(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 1000, (samples, 16), generator=generator))


ARCHITECTURES: dict[str, Architecture] = {
    "resnet": Architecture(lambda: Classifier(resnet(), OPTIMIZERS["sgd_momentum"]), images, 8),
    "encoder": Architecture(lambda: Classifier(encoder(), OPTIMIZERS["adamw"]), sequences, 8),
    "lstm": Architecture(lambda: Classifier(lstm(), OPTIMIZERS["adam"]), tokens, 8),
    "mlp": Architecture(lambda: Classifier(mlp(), OPTIMIZERS["adam"]), vectors, 16),
    "gpt2": Architecture(lambda: CausalLM(), text, 4),
}


def counted_step(
    root: Path,
    module: pl.LightningModule,
    data: Dataset[Any],
    batch_size: int,
    steps: int = 3,
    callbacks: tuple[pl.Callback, ...] = (),
    **options: Any,
) -> tuple[Attribution, Any]:
    """Train ``module`` for ``steps`` steps with the monitor counting step 1; its counts and the first batch.

    ``callbacks`` run before the monitor's hooks. The monitor's own replays (in training, preflight) are off: the
    callers replay the counted step with a Predictor of their own, and nothing reads the monitor's.
    """
    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=None, console_summary=False, **REPLAYS_OFF
    )
    batches = loader(data, batch_size)
    trainer(root, [*callbacks, monitor], max_steps=steps, **options).fit(module, batches)
    attribution = monitor.session._recorder.tracker.latest_attribution
    assert attribution is not None and attribution.step == 1
    return attribution, next(iter(batches))
