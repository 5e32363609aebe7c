"""Every piece of advice a fine-tuned transformers model gets, applied as printed: the live peak falls as predicted.

Checkpointing (the model's own switch) is applied on each architecture in tests/test_checkpoint_idiom.py; here each
architecture's whole advice list is pinned to what is applied somewhere, and chunked-loss is applied on the causal
language models (its printed ``chunked_cross_entropy``, called as its commented lines for a transformers model say:
the model's last hidden states and its ``lm_head``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from chunked_loss_printed import printed
from models import loader, trainer
from transformers_models import ARCHITECTURES, FineTuned, data

from lightning_vram import Report, VramMonitor
from lightning_vram.records import AdviceId

# Every piece of a run's advice is applied and checked against its replayed prediction.
pytestmark = pytest.mark.replay

pytest.importorskip("transformers")

LENGTH = 128
APPLIED_ELSEWHERE = {AdviceId.ACTIVATION_CHECKPOINTING}
"""Advice applied on these architectures in another test file (tests/test_checkpoint_idiom.py)."""
APPLIED_HERE = {AdviceId.CHUNKED_LOSS}


def _report(root: Path, module: FineTuned) -> Report:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(data(module.kind, LENGTH, samples=32), 4))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


class Recorded(FineTuned):
    """The model trained on its own loss (``labels=``), each step's loss kept."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind, LENGTH)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())  # read after the run: .item() in the step stops the replay
        return loss


class ChunkedLoss(FineTuned):
    """The causal language model with its loss computed by the advice's ``chunked_cross_entropy``, called as the
    advice's commented lines for a transformers model say (``ids`` and ``mask``: the batch's tokens and mask;
    ``labels``: the tokens, as ``FineTuned`` passes them)."""

    def __init__(self, kind: str, chunked_cross_entropy: Any, usage: str) -> None:
        super().__init__(kind, LENGTH)
        self.chunked_cross_entropy = chunked_cross_entropy
        self.usage = usage
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, mask = batch
        namespace = {
            "model": self.model,
            "ids": tokens,
            "mask": mask,
            "labels": tokens,  # as FineTuned passes labels=tokens
            "chunked_cross_entropy": self.chunked_cross_entropy,
        }
        exec(self.usage, namespace)  # the advice's own lines, as a user would paste them
        loss: torch.Tensor = namespace["loss"]
        self.losses.append(loss.detach().clone())  # read after the run: .item() in the step stops the replay
        return loss


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_every_piece_of_advice_is_one_that_is_applied(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    plain = Recorded(kind)
    report = _report(tmp_path / "before", plain)
    assert report.simulation is not None and report.simulation.skipped is None, report.simulation
    given = {advice.id for advice in report.advice}
    assert given, "a 128-token batch of a transformers model is worth some advice"
    assert given <= APPLIED_ELSEWHERE | APPLIED_HERE, given
    chunked = next((advice for advice in report.advice if advice.id is AdviceId.CHUNKED_LOSS), None)
    if chunked is None:
        return
    torch.manual_seed(0)
    helper, usage = printed(chunked, "# A causal LM", "hidden =")
    chunked_module = ChunkedLoss(kind, helper, usage)
    applied = _report(tmp_path / "after", chunked_module)
    # The printed lines compute the loss labels= computes (its shift, its -100), to float32 rounding.
    assert [loss.item() for loss in chunked_module.losses] == pytest.approx(
        [loss.item() for loss in plain.losses], rel=1e-5
    )
    assert report.peak is not None and applied.peak is not None
    realised = report.peak.peak_bytes - applied.peak.peak_bytes
    assert chunked.estimated_saving_bytes is not None
    assert abs(realised - chunked.estimated_saving_bytes) <= 0.1 * chunked.estimated_saving_bytes, (
        realised,
        chunked.estimated_saving_bytes,
    )
    assert AdviceId.CHUNKED_LOSS not in {advice.id for advice in applied.advice}
