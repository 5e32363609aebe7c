"""Under gradient accumulation the report's peak is measured on a micro-batch holding the window's gradients.

A new user's trial (a BiLSTM tagger in a plain loop, ``VramSession``, accumulating 2): the sampled step, batch 2, was
the first micro-batch of its window, holding no gradients before its backward and taking no optimizer step. The
headline said "Live peak 40.9 MiB ... step 2" with gradients 0 B, while batch 3, measured alone, peaked at 43.9 MiB
with 3.0 MiB of gradients: the headline and the JSON ``peak`` were 7% low. A sampled micro-batch that does not step
now has its window's stepping micro-batch sampled too, and the report says which micro-batch its peak was measured
on. The same held for a Trainer with ``accumulate_grad_batches``. Replays off: what is read here is measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor, VramSession
from lightning_vram.codec import report_from_dict
from lightning_vram.records import Phase, Report
from lightning_vram.render.text import summary_text

VOCABULARY, TAGS, LENGTH, BATCH = 100, 5, 12, 4


class Tagger(nn.Module):
    """An embedding, a bidirectional LSTM and a linear head: a tag per token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, TAGS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])  # type: ignore[no-any-return]


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    ids, tags = batch
    return nn.functional.cross_entropy(module(ids).flatten(0, 1), tags.flatten())


def tagged(batches: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCABULARY, (batches * BATCH, LENGTH), generator=generator)
    return TensorDataset(ids, torch.randint(0, TAGS, (batches * BATCH, LENGTH), generator=generator))


def plain(session: VramSession | None, window: int, batches: int, log_dir: Path | None = None) -> dict[str, Any]:
    """A plain loop stepping SGD with momentum every ``window``-th batch; what training left behind."""
    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = DataLoader(tagged(batches), batch_size=BATCH)
    if session is not None:
        session.start(model, [optimizer], dataloader=data, step_function=loss_of, accumulate_grad_batches=window)
    losses = []
    for index, batch in enumerate(data):
        if session is not None:
            session.batch_start(batch)
        loss = loss_of(model, batch) / window
        if session is not None:
            session.before_backward()
        loss.backward()  # type: ignore[no-untyped-call]
        if (index + 1) % window == 0:
            if session is not None:
                session.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
        if session is not None:
            session.batch_end()
        losses.append(loss.detach())
    if session is not None:
        session.finish()
    return {"losses": losses, "weights": model.state_dict(), "optimizer": optimizer.state_dict()}


def same(left: Any, right: Any) -> bool:
    """Bitwise equality through tensors, dicts and lists."""
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and torch.equal(left, right)
    if isinstance(left, dict):
        return isinstance(right, dict) and left.keys() == right.keys() and all(same(left[k], right[k]) for k in left)
    if isinstance(left, list):
        return isinstance(right, list) and len(left) == len(right) and all(map(same, left, right))
    return bool(left == right)


def assert_measured_holding_the_window(report: Report, step: int, micro_batch: int, window: int) -> None:
    peak = report.peak
    assert peak is not None and peak.breakdown is not None
    assert (peak.step, peak.micro_batch) == (step, micro_batch), peak
    assert peak.breakdown.gradients == peak.breakdown.parameters > 0  # the window's gradients, held
    assert report.phases[Phase.OPTIMIZER].step == step - micro_batch + window  # the stepping micro-batch, measured
    steps = ", which steps the optimizer" if micro_batch == window else ""
    assert f"of step {step} (micro-batch {micro_batch} of {window}{steps})" in summary_text(report, width=400)
    data = report.to_dict()
    assert data["peak"]["micro_batch"] == micro_batch and data["peak"]["step"] == step
    assert report_from_dict(data).to_dict() == data


@pytest.mark.parametrize(
    ("window", "sampled", "peaked", "micro_batch"),
    [
        (2, 2, 3, 2),  # the first micro-batch sampled: the second, which steps, peaks
        (4, 4, 7, 4),  # the first of four: the fourth is sampled too, and peaks
        (4, 5, 5, 2),  # the second holds the window's gradients already: it peaks as high as the fourth, sampled too
    ],
)
def test_a_plain_loop_s_sampled_micro_batch_that_does_not_step_has_its_window_s_stepping_one_measured(
    tmp_path: Path, window: int, sampled: int, peaked: int, micro_batch: int
) -> None:
    session = VramSession(
        log_dir=tmp_path, attribution_start_step=sampled, attribution_every_n_steps=None, console_summary=False
    )
    watched = plain(session, window, batches=12)
    assert same(plain(None, window, batches=12), watched)
    report = session.report
    assert report is not None
    assert_measured_holding_the_window(report, peaked, micro_batch, window)
    written = json.loads((tmp_path / "vram_report.json").read_text())
    assert written["peak"] == report.to_dict()["peak"]


def test_a_plain_loop_s_header_counts_optimizer_steps_and_json_steps_counts_batches(tmp_path: Path) -> None:
    session = VramSession(log_dir=tmp_path, console_summary=False)
    plain(session, 2, batches=24)
    report = session.report
    assert report is not None
    header = summary_text(report, width=400).splitlines()[0]
    assert header.endswith("(cpu), 12 optimizer steps (24 batches, accumulation 2)")
    written = json.loads((tmp_path / "vram_report.json").read_text())
    assert (written["steps"], written["optimizer_steps"], written["accumulate_grad_batches"]) == (24, 12, 2)


class LightningTagger(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.tagger = Tagger()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(self.tagger, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_trainer_accumulating_has_its_peak_measured_on_the_window_s_stepping_micro_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3, accumulate_grad_batches=2).fit(
        LightningTagger(), DataLoader(tagged(8), batch_size=BATCH)
    )
    report = monitor.report
    assert report is not None and report.steps == 6
    assert_measured_holding_the_window(report, 3, 2, 2)
