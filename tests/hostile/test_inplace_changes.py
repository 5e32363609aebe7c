"""A saved tensor changed in place before backward: the user's backward fails with the monitor as it does without.

The monitor's saved-tensor hooks switch off autograd's own version check on the steps they count, so they make the
check themselves: otherwise the user's error would be swallowed and training would go on with wrong gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, Case, monitor_for, train
from models import dataset_for, loader
from torch import nn

from lightning_vram import VramSession

MODIFIED = "modified by an inplace operation"


class ChangesWhatItSaved(pl.LightningModule):
    """On its third forward pass, changes in place a tensor autograd saved: sigmoid's output, or a weight."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(32, 16), nn.Linear(16, 10)
        self.target, self.calls = target, 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.sigmoid(self.first(inputs))
        outputs = self.second(hidden)
        self.calls += 1
        if self.calls == 3:
            with torch.no_grad():
                (hidden if self.target == "activation" else self.second.weight).add_(1.0)
        return outputs

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def failure(run: Any) -> str:
    with pytest.raises(RuntimeError, match=MODIFIED) as raised:
        run()
    return type(raised.value).__name__


@pytest.mark.parametrize("target", ["activation", "weight"])
@pytest.mark.parametrize("path", PATHS)
def test_a_counted_step_whose_saved_tensor_changed_fails_as_without_the_monitor(
    tmp_path: Path, path: str, target: str
) -> None:
    def case() -> Case:
        return Case(ChangesWhatItSaved(target), loader(dataset_for("linear")))

    bare = failure(lambda: train(case, tmp_path / "bare", None))
    every_step = monitor_for(path, attribution_start_step=0, attribution_every_n_steps=1)
    watched = failure(lambda: train(case, tmp_path / "watched", every_step))
    assert bare == watched == "RuntimeError"


def test_a_plain_loop_whose_saved_tensor_changed_fails_as_without_the_session() -> None:
    def run(session: VramSession | None) -> None:
        torch.manual_seed(0)
        module = ChangesWhatItSaved("activation")
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        if session is not None:
            session.start(module, [optimizer])
        for step, batch in enumerate(loader(dataset_for("linear"))):
            if session is not None:
                session.batch_start(batch)
            loss = module.training_step(batch, step)
            if session is not None:
                session.before_backward()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if session is not None:
                session.batch_end()

    assert failure(lambda: run(None)) == "RuntimeError"
    session = VramSession(attribution_start_step=0, attribution_every_n_steps=1, console_summary=False)
    assert failure(lambda: run(session)) == "RuntimeError"
    session.close()
