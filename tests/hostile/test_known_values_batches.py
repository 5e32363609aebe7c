"""Batches whose values the step reads, changes in place, or wraps in containers: the monitor leaves them alone.

The replay carries the real values of the batch's small tensors (``KnownValues``) and runs at the sampled step's end.
A step that branches on a mask, reads ``.item()`` and ``nonzero``, and then changes its batch in place trains the same
with the monitor as without (the user's batches and what the step saw compared too), and the replay takes the
branches the step took, from the values the step started with: before, it read the changed batch, so the mask
inverted took other branches (the replay "does not reproduce sampled step 1": 14,160 forward bytes against 14,736),
and with the labels shifted too the replay failed on an in-place change the real step never saw (skipped).
"""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, Case, assert_untouched
from torch import nn
from torch.utils.data import DataLoader, Dataset

Pair = namedtuple("Pair", ["inputs", "mask"])


class Masked(Dataset[dict[str, Any]]):
    """Inputs, a mask with some rows off, labels, and non-tensor fields (names, a namedtuple, a number)."""

    def __init__(self, samples: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(samples, 16, generator=generator)
        self.mask = torch.rand(samples, 16, generator=generator) > 0.2
        self.labels = torch.randint(0, 4, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "pair": Pair(self.inputs[index], self.mask[index]),
            "labels": self.labels[index],
            "name": f"sample-{index}",
            "weight": 0.5,
        }


class ReadsAndChangesItsBatch(pl.LightningModule):
    """Branches on the mask's values, reads ``.item()`` and ``nonzero``, then changes the batch in place."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.seen: list[tuple[Any, ...]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        inputs, mask = batch["pair"]
        kept = inputs * mask if not mask.all() else inputs
        rows = torch.nonzero(mask.sum(dim=1) > 8).flatten()
        count = int(mask.sum().item())
        logits = self.net(kept[rows] if len(rows) else kept)
        labels = batch["labels"][rows] if len(rows) else batch["labels"]
        loss = nn.functional.cross_entropy(logits, labels) * batch["weight"][0]
        self.seen.append((count, len(rows), batch["name"][0]))
        with torch.no_grad():  # the user's own in-place changes to the batch, after the values were read
            inputs.mul_(2.0)
            mask.logical_not_()
            batch["labels"].add_(1).remainder_(4)
        batch["name"].append("changed")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_reading_and_changing_its_batch_trains_as_without_the_monitor(tmp_path: Path, path: str) -> None:
    batches: list[dict[str, Any]] = []
    modules: list[ReadsAndChangesItsBatch] = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            batches.append(args[3])

    def build() -> Case:
        batches.clear()
        modules.clear()
        module = ReadsAndChangesItsBatch()
        modules.append(module)
        return Case(
            module,
            DataLoader(Masked(), batch_size=8),
            observe=lambda: (list(module.seen), [dict(batch) for batch in batches]),
            after_monitor=[Keep()],
        )

    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    assert monitor.report is not None
    assert monitor.report.simulation is not None and monitor.report.simulation.skipped is None


def test_a_taken_value_is_used_only_for_the_tensor_it_was_taken_from() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_vram.prediction.replay.known_values import KnownValues, taken_values

    started, replaced = torch.tensor([1, 2, 3]), torch.tensor([7, 8])
    taken = taken_values({"started": started})
    started.mul_(10)  # the step changes it in place: the replay knows it as it started
    reused = {id(replaced): taken[id(started)]}  # a new tensor that took a dropped one's id: not taken for it
    mode = FakeTensorMode()
    fake_started, fake_replaced = mode.from_tensor(started), mode.from_tensor(replaced)
    values = KnownValues()
    values.know([(fake_started, started)], taken)
    values.know([(fake_replaced, replaced)], reused)
    assert torch.equal(values.value_of(fake_started), torch.tensor([1, 2, 3]))  # type: ignore[arg-type]
    assert torch.equal(values.value_of(fake_replaced), torch.tensor([7, 8]))  # type: ignore[arg-type]
