"""A block shared across layers (ALBERT's: one layer's weights, called in a loop) is checkpointed as a whole.

``Checkpointed`` in the block's place checkpoints each of its calls: each keeps its input, and backward recomputes
one call at a time. Before, a module that ran more often than its caller was never a unit (meant for a block's one
ReLU, run twice among its siblings), so the planner offered only units inside the block, each saving next to
nothing: the run got no advice ("checkpoint network.shared.norm ... saves 80.0 KiB (0.2% of the measured peak)"),
while checkpointing the block realises 23,674,880 B of a 34,111,452 B peak and trains the same model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from models import loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.records import Advice, AdviceId

pytestmark = pytest.mark.replay  # the advice and its saving come from the replay


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class SharedLayers(nn.Module):
    """One block, its weights shared by six layers (ALBERT's cross-layer sharing)."""

    def __init__(self, width: int = 64, layers: int = 6) -> None:
        super().__init__()
        self.inputs = nn.Linear(32, width)
        self.shared = Block(width)
        self.layers = layers
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inputs(x)
        for _ in range(self.layers):
            h = self.shared(h)
        return self.head(h.mean(1))


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.network = SharedLayers()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        loss = F.cross_entropy(self.network(inputs), labels)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 128, 32, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 10, (64,), generator=generator))


def fit(root: Path, module: Classifier, monitored: bool) -> Report | None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor] if monitored else [], max_steps=3).fit(module, loader(data(), 16))
    return monitor.report if monitored else None


def applied(advice: Advice, kind: type[Classifier] = Classifier) -> Classifier:
    """A fresh ``kind`` with the advice's code applied as printed (the definitions, then its ``__init__`` lines)."""
    block = re.search(r"```python\n(.*?)```", advice.detail, re.S)
    assert block is not None, advice.detail
    definitions, _, lines = block.group(1).partition("\n# in ")
    assert lines.startswith("the LightningModule's __init__"), lines
    namespace: dict[str, Any] = {}
    exec(definitions, namespace)  # the advice's own code, as a user would paste it
    torch.manual_seed(0)
    module = kind()
    exec("\n".join(lines.split("\n")[1:]), {**namespace, "self": module})
    return module


def advised(root: Path, kind: type[Classifier]) -> tuple[Report, Advice]:
    """A monitored run of ``kind`` and its checkpointing advice (the test fails where there is none)."""
    torch.manual_seed(0)
    report = fit(root, kind(), monitored=True)
    assert report is not None and report.peak is not None
    advice = next((advice for advice in report.advice if advice.id is AdviceId.ACTIVATION_CHECKPOINTING), None)
    assert advice is not None, report.to_dict().get("not_advised")
    return report, advice


def assert_applied_saves_and_trains_the_same(
    root: Path, report: Report, advice: Advice, kind: type[Classifier], module: Classifier
) -> None:
    """``module`` (a ``kind`` with ``advice`` applied as printed) lowers the peak by the advice's saving (1%), is
    not advised checkpointing again, and it and an unmonitored copy train as ``kind`` without the change: the same
    losses, weights (``.block`` renames the keys, not their order) and global RNG, bit for bit."""
    after = fit(root / "after", module, monitored=True)
    assert report.peak is not None and after is not None and after.peak is not None
    assert advice.estimated_saving_bytes is not None
    realised = report.peak.peak_bytes - after.peak.peak_bytes
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.01)
    assert AdviceId.ACTIVATION_CHECKPOINTING not in {advice.id for advice in after.advice}
    torch.manual_seed(0)
    plain = kind()
    fit(root / "plain", plain, monitored=False)
    plain_rng = torch.get_rng_state()
    torch.manual_seed(0)
    unmonitored = applied(advice, kind)
    fit(root / "unmonitored", unmonitored, monitored=False)
    assert torch.equal(torch.get_rng_state(), plain_rng)
    for trained in (module, unmonitored):
        assert [loss.item() for loss in trained.losses] == [loss.item() for loss in plain.losses]
        weights = list(trained.state_dict().values())
        assert all(torch.equal(a, b) for a, b in zip(weights, plain.state_dict().values(), strict=True))


def test_a_shared_block_is_checkpointed_whole_saves_what_it_said_and_trains_the_same(tmp_path: Path) -> None:
    report, advice = advised(tmp_path / "before", Classifier)  # before: none, a unit inside the block saved 0.2%
    assert "`network.shared`" in advice.title
    # seen: 23,674,880 B realised, as simulated
    assert_applied_saves_and_trains_the_same(tmp_path, report, advice, Classifier, applied(advice))
