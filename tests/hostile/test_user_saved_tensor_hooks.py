"""H1: the user's own saved-tensor hooks keep working on sampled steps.

Found attacking 0.11.0: torch runs only the innermost pair of ``saved_tensors_hooks``, and on sampled steps the
monitor's replaced the user's: a pair set around ``trainer.fit`` or by a Callback stopped running, and lossy
activation compression gave different losses and weights from the first sampled step. A pair active when a step
begins now makes the monitor stand aside for it. Each case trains with and without the monitor, every step sampled,
compared exactly, the user's pack count included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, loader
from torch import nn
from torch.utils.data import TensorDataset


class Compression:
    """Lossy activation compression: saved tensors kept in bfloat16, restored to their dtype; packs counted."""

    def __init__(self) -> None:
        self.packs = 0

    def pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        self.packs += 1
        return tensor.to(torch.bfloat16), tensor.dtype

    def unpack(self, packed: tuple[torch.Tensor, torch.dtype]) -> torch.Tensor:
        tensor, dtype = packed
        return tensor.to(dtype)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class CompressingCallback(pl.Callback):
    """Compresses every batch's saved activations: the pair entered at the batch's start, left at its end."""

    def __init__(self, compression: Compression) -> None:
        self.compression = compression
        self._open: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        self._open = self.compression.hooks()
        self._open.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        self._open.__exit__(None, None, None)


def build(compression: Compression, callback: bool) -> Case:
    compression.packs = 0
    network = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 10))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 16, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    callbacks = [CompressingCallback(compression)] if callback else []
    return Case(Classifier(network), loader(data), observe=lambda: compression.packs, before_monitor=callbacks)


@pytest.mark.parametrize("path", PATHS)
def test_a_compressing_pair_around_fit_keeps_compressing_on_sampled_steps(tmp_path: Path, path: str) -> None:
    compression = Compression()
    with compression.hooks():
        monitor = assert_untouched(
            lambda: build(compression, False), tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1
        )
    assert monitor.report is not None
    assert any("saved-tensor hooks of the training code" in item.reason for item in monitor.report.not_measured)


@pytest.mark.parametrize("path", PATHS)
def test_a_callbacks_compressing_pair_keeps_compressing_on_sampled_steps(tmp_path: Path, path: str) -> None:
    compression = Compression()
    assert_untouched(
        lambda: build(compression, True), tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1
    )
    assert compression.packs > 0
