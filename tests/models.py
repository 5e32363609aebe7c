"""Tiny LightningModules whose bytes can be worked out by hand, and helpers to train them on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_vram.config import MonitorConfig

FLOAT32 = 4

# Replays in tests (tests/conftest.py): off unless a test asks, by its `replay` marker or by naming these options.
REPLAY_OPTIONS = frozenset({"replay_budget_seconds", "preflight"})
REPLAYS_OFF: dict[str, Any] = {"replay_budget_seconds": 0.0, "preflight": False}
TEST_REPLAY_BUDGET_SECONDS = 600.0
"""The replay budget of a test's monitor that replays without naming one, in host seconds (the library's default is
``MonitorConfig``'s 30 s). The budget is wall time: on a loaded machine 30 s ran out before the last plan of a test's
search (tests/test_checkpointing_same_model.py's ResNet blocks, once), so what a test read depended on the load. No
test replays for more than about 20 s on an idle machine: the longer budget changes no idle run and only catches a hang
later. A test of the budget itself names its own."""
REPLAYS_ON: dict[str, Any] = {
    "replay_budget_seconds": TEST_REPLAY_BUDGET_SECONDS,
    "preflight": MonitorConfig.preflight,
}
"""The tests' replay defaults, named: a monitor built with them replays whatever the test's marker says."""
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

# partials, not lambdas: modules holding them pickle (ddp_spawn sends the module to its workers).
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": partial(torch.optim.SGD, lr=0.01),
    "sgd_momentum": partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "adam": partial(torch.optim.Adam, lr=1e-3),
    "adamw": partial(torch.optim.AdamW, lr=1e-3),
    "adagrad": partial(torch.optim.Adagrad, lr=0.01),
}


class Classifier(pl.LightningModule):
    """A network, a loss and an optimizer; the batch is ``(inputs, targets)``."""

    def __init__(self, network: nn.Module, optimizer: OptimizerFactory = OPTIMIZERS["sgd"]) -> None:
        super().__init__()
        self.network = network
        self.optimizer_factory = optimizer

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.network(inputs)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


class BasicBlock(nn.Module):
    """A torchvision-style ResNet basic block: conv-BN-ReLU(inplace)-conv-BN, the input added back, ReLU(inplace)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(inputs)))
        out = self.bn2(self.conv2(out))
        out += inputs
        return self.relu(out)  # type: ignore[no-any-return]


class LastStep(nn.Module):
    """Keeps the last time step of an LSTM's output: ``(batch, time, hidden) -> (batch, hidden)``."""

    def forward(self, outputs: tuple[torch.Tensor, Any]) -> torch.Tensor:
        return outputs[0][:, -1]


def linear_net() -> nn.Module:
    """Linear(32, 10): 32*10 + 10 = 330 parameters."""
    return nn.Sequential(nn.Linear(32, 10))


def cnn_net() -> nn.Module:
    """Conv2d(3, 8, 3) + BatchNorm2d(8) + ReLU + pool + Linear(8, 10)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def lstm_net() -> nn.Module:
    """Embedding(50, 16) + LSTM(16, 24) + Linear(24, 10), on token ids."""
    return nn.Sequential(nn.Embedding(50, 16), nn.LSTM(16, 24, batch_first=True), LastStep(), nn.Linear(24, 10))


def transformer_net() -> nn.Module:
    """One TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32), mean-pooled, + Linear(16, 10)."""
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False), MeanOverTime(), nn.Linear(16, 10)
    )


class MeanOverTime(nn.Module):
    """``(batch, time, features) -> (batch, features)``."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.mean(dim=1)


# Parameter counts from the layer formulas (DOMAIN.md), not from the modules.
PARAMETER_COUNTS = {
    "linear": 32 * 10 + 10,
    "cnn": (3 * 8 * 3 * 3 + 8) + 2 * 8 + (8 * 10 + 10),
    # LSTM: 4 gates, W_ih (4H x I) + W_hh (4H x H) + two biases of 4H.
    "lstm": 50 * 16 + (4 * 24 * 16 + 4 * 24 * 24 + 2 * 4 * 24) + (24 * 10 + 10),
    # Encoder layer: in_proj (3d x d + 3d), out_proj (d x d + d), linear1 (f x d + f), linear2 (d x f + d),
    # two LayerNorms (2d each); then the head.
    "transformer": (3 * 16 * 16 + 3 * 16)
    + (16 * 16 + 16)
    + (32 * 16 + 32)
    + (16 * 32 + 16)
    + 2 * (2 * 16)
    + (16 * 10 + 10),
}

NETWORKS: dict[str, Callable[[], nn.Module]] = {
    "linear": linear_net,
    "cnn": cnn_net,
    "lstm": lstm_net,
    "transformer": transformer_net,
}


def dataset_for(name: str, samples: int = 64, seed: int = 0) -> TensorDataset:
    """Synthetic inputs shaped for network ``name`` and random class targets."""
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 10, (samples,), generator=generator)
    if name == "linear":
        inputs = torch.randn(samples, 32, generator=generator)
    elif name == "cnn":
        inputs = torch.randn(samples, 3, 8, 8, generator=generator)
    elif name == "lstm":
        inputs = torch.randint(0, 50, (samples, 7), generator=generator)
    else:
        inputs = torch.randn(samples, 6, 16, generator=generator)
    return TensorDataset(inputs, targets)


def loader(dataset: Dataset[Any], batch_size: int = 8) -> DataLoader[Any]:
    """A plain, unshuffled DataLoader (same batch shapes every step)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)


def trainer(root: Path, callbacks: list[pl.Callback], max_steps: int = 4, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer for tests."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "default_root_dir": root,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def saved_storage_bytes(step: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes autograd saves while ``step()`` runs, counted directly: unique storages, minus ``exclude``'s storages."""
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(saved.values())


class ScriptedClock:
    """A host clock for ``VramMonitor(clock=...)``: the time in seconds moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SlowToLoad(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample takes ``seconds`` of the scripted clock to load, like decoding an image from disk."""

    def __init__(self, data: TensorDataset, clock: ScriptedClock, seconds: float) -> None:
        self.data, self.clock, self.seconds = data, clock, seconds

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.clock.now += self.seconds
        inputs, target = self.data[index]
        return inputs, target


class TimedClassifier(Classifier):
    """A Classifier whose training step takes ``seconds`` of the scripted clock."""

    def __init__(self, network: nn.Module, clock: ScriptedClock, seconds: float) -> None:
        super().__init__(network)
        self.clock, self.seconds = clock, seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += self.seconds
        return super().training_step(batch, batch_idx)


def dataset(width: int, samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, width, generator=generator), torch.randint(0, 10, (samples,)))


def mlp(width: int, depth: int, inplace: bool = False, activation: type[nn.Module] = nn.LeakyReLU) -> nn.Sequential:
    """``depth`` times Linear + activation, then Linear(width, 10).

    LeakyReLU out of place saves its input while the next Linear saves its output: inplace frees one of the two.
    """
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), activation(inplace=inplace)]
    return nn.Sequential(*layers, nn.Linear(width, 10))
