"""H2: torch.func transforms that refuse saved-tensor hooks, under every import form, in a step or a forward.

Found attacking 0.11.0: ``from torch.func import grad`` (``torch.func.grad.__module__`` is ``"torch.func"``), ``as G``,
``import torch.func as tf; tf.grad``, ``vmap(grad(f))`` and per-sample gradients were not recognised, and training
raised "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks" on the first sampled step. The
code walk now knows the transforms by identity; each case trains with and without the monitor, compared exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.func as tf
from harness import PATHS, Case, assert_untouched
from models import Classifier, loader
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.func import grad as G
from torch.utils.data import TensorDataset


def squares(x: torch.Tensor) -> torch.Tensor:
    return (x**2).sum()


class FromImport(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-3 * grad(squares)(batch[0]).mean()


class Renamed(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-3 * G(squares)(batch[0]).mean()


class ModuleAlias(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-3 * tf.grad(squares)(batch[0]).mean()


class VmapOfGrad(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-3 * vmap(grad(squares))(batch[0]).mean()


class PerSampleGradients(Classifier):
    """The tutorial's per-sample gradients: vmap over grad of a functional_call of the network."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        params = {name: value.detach() for name, value in self.network.named_parameters()}

        def sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = functional_call(self.network, params, (x.unsqueeze(0),))
            return nn.functional.cross_entropy(logits, y.unsqueeze(0))

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, targets)
        norm = sum(value.flatten(1).norm(dim=1).mean() for value in per_sample.values())
        return super().training_step(batch, batch_idx) + 1e-3 * norm


class PenaltyInForward(nn.Module):
    """A network whose own forward adds a jacrev gradient penalty (as a regulariser would)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        jacobian = jacrev(lambda row: torch.tanh(row).sum())(x[0].detach())
        return self.body(x) + 1e-3 * jacobian.sum()


CASES: dict[str, Any] = {
    "from torch.func import grad": lambda: FromImport(mlp()),
    "grad as G": lambda: Renamed(mlp()),
    "import torch.func as tf": lambda: ModuleAlias(mlp()),
    "vmap(grad(f))": lambda: VmapOfGrad(mlp()),
    "per-sample gradients": lambda: PerSampleGradients(mlp()),
    "jacrev in a forward": lambda: Classifier(PenaltyInForward()),
}


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 16, generator=generator), torch.randint(0, 10, (32,), generator=generator))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", PATHS)
def test_torch_func_in_any_import_form_trains_as_without_the_monitor(tmp_path: Path, path: str, case: str) -> None:
    monitor = assert_untouched(
        lambda: Case(CASES[case](), loader(data())),
        tmp_path,
        path,
        attribution_start_step=0,
        attribution_every_n_steps=1,
    )
    assert monitor.report is not None
    reasons = [entry.reason for entry in monitor.report.not_measured]
    assert any("torch.func." in reason and "were not counted tensor by tensor" in reason for reason in reasons)
