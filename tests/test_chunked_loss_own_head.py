"""The chunked-loss advice names the run's own head where one module's output is the logits (a model of the user's
own, not a ``transformers`` one).

Before, a trial's LSTM language model was shown transformers' lines alone (``model.lm_head``, ``model.model``) and
had to find its head itself. The printed code now names ``self.out``: applied as printed (the helper, and its line
with the LSTM's output as ``hidden``), the loss agrees with the model's own to float32 rounding, the peak falls by
the saving the advice promised (within 10%), and the advice is gone.
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
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.records import AdviceId

pytestmark = pytest.mark.replay  # the advice comes from the replayed baseline

VOCAB, WIDTH = 8000, 64


class LstmLanguageModel(pl.LightningModule):
    """Embedding, a 2-layer LSTM and a Linear head over the vocabulary; with ``printed``, the advice's loss line."""

    def __init__(self, printed: tuple[Any, str] | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, 2, batch_first=True)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.printed = printed
        self.losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (tokens,) = batch
        hidden, _ = self.rnn(self.embedding(tokens[:, :-1]))
        targets = tokens[:, 1:]
        if self.printed is None:
            loss = F.cross_entropy(self.out(hidden).reshape(-1, VOCAB), targets.reshape(-1))
        else:
            helper, line = self.printed
            namespace = {"self": self, "hidden": hidden, "targets": targets, "chunked_cross_entropy": helper}
            exec(line, namespace)  # the advice's own line, as a user would paste it
            loss = namespace["loss"]
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root: Path, module: LstmLanguageModel) -> Report:
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (48, 65), generator=torch.Generator().manual_seed(0)))
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(data, 16))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


def test_a_language_model_of_its_own_is_told_its_head_and_the_printed_line_saves_what_was_said(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = LstmLanguageModel()
    report = fit(tmp_path / "own", plain)
    advice = next((advice for advice in report.advice if advice.id is AdviceId.CHUNKED_LOSS), None)
    assert advice is not None, report.to_dict().get("not_advised")
    block = re.search(r"```python\n(.*?)```", advice.detail, re.S)
    assert block is not None
    lines = block.group(1).splitlines()
    at = next((index for index, line in enumerate(lines) if line.startswith("# In your step")), None)
    assert at is not None, block.group(1)  # before: no line named the run's own head
    line = next(line.removeprefix("# ") for line in lines[at:] if line.startswith("# loss ="))
    assert line == "loss = chunked_cross_entropy(hidden.flatten(0, 1), self.out, targets.flatten())"
    namespace: dict[str, Any] = {}
    exec(block.group(1), namespace)  # the advice's own code, as a user would paste it
    torch.manual_seed(0)
    chunked = LstmLanguageModel((namespace["chunked_cross_entropy"], line))
    after = fit(tmp_path / "chunked", chunked)
    assert [loss.item() for loss in chunked.losses] == pytest.approx([loss.item() for loss in plain.losses], rel=1e-5)
    assert report.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    realised = report.peak.peak_bytes - after.peak.peak_bytes
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.10)
    assert AdviceId.CHUNKED_LOSS not in {advice.id for advice in after.advice}
