"""The report's header counts steps as Lightning does: optimizer steps, with the batches they took where they differ.

A ViT trained with ``accumulate_grad_batches=2`` and ``max_steps=20`` had a header of "40 steps" where Lightning
said 20 (its ``max_steps`` and ``global_step`` count optimizer steps; the monitor counted batches). Now the header
says "20 optimizer steps (40 batches, accumulation 2)", a two-optimizer GAN's "8 optimizer steps (4 batches)",
and a run stepping once a batch keeps its short "N steps". ``steps`` in the JSON stays the batches (its meaning is
public); ``optimizer_steps`` and ``accumulate_grad_batches`` are added beside it.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import trainer
from test_manual_phases import ConvGan, images
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.codec import report_from_dict
from lightning_vram.measure.tracker import MemoryTracker


class TinyViT(pl.LightningModule):
    """Patches of 4 x 4 pixels embedded to 32 features, one encoder layer, a class token's head; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 32, kernel_size=4, stride=4)
        self.position = nn.Parameter(torch.zeros(1, 16, 32))
        layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        tokens = self.patches(inputs).flatten(2).transpose(1, 2) + self.position
        return nn.functional.cross_entropy(self.head(self.encoder(tokens).mean(dim=1)), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def pictures() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 3, 16, 16, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    )
    return DataLoader(data, batch_size=4)


def header_everywhere(root: Path, out: str) -> tuple[str, str, str, dict[str, Any]]:
    """The console's first line, the Markdown and HTML pages, and the JSON the run wrote under ``root``."""
    return (
        out.splitlines()[0],
        (root / "vram_report.md").read_text(),
        (root / "vram_report.html").read_text(),
        json.loads((root / "vram_report.json").read_text()),
    )


def test_under_accumulation_the_header_counts_optimizer_steps_and_the_batches_they_took(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=2)
    fit = trainer(tmp_path, [monitor], max_steps=5, accumulate_grad_batches=2)
    fit.fit(TinyViT(), pictures())
    assert fit.global_step == 5
    report = monitor.report
    assert report is not None
    assert (report.steps, report.optimizer_steps, report.accumulate_grad_batches) == (10, 5, 2)
    console, markdown, page, data = header_everywhere(tmp_path, capsys.readouterr().out)
    said = "5 optimizer steps (10 batches, accumulation 2)"
    assert console.endswith(f"(cpu), {said}")
    assert f"; {said}; " in markdown and f"; {said}; " in page
    assert (data["steps"], data["optimizer_steps"], data["accumulate_grad_batches"]) == (10, 5, 2)
    assert report_from_dict(data).to_dict() == data == report.to_dict()


def test_a_run_stepping_once_a_batch_keeps_its_short_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monitor = VramMonitor(attribution_start_step=2)
    fit = trainer(tmp_path, [monitor], max_steps=3)
    fit.fit(TinyViT(), pictures())
    report = monitor.report
    assert report is not None and fit.global_step == 3
    assert (report.steps, report.optimizer_steps, report.accumulate_grad_batches) == (3, 3, 1)
    console, markdown, page, data = header_everywhere(tmp_path, capsys.readouterr().out)
    assert console.endswith("(cpu), 3 steps")
    assert "; 3 steps; " in markdown and "; 3 steps; " in page
    assert "each the highest of its kind" not in markdown and "(manual optimization)" not in page
    assert (data["steps"], data["optimizer_steps"]) == (3, 3)


def test_a_gan_under_manual_optimization_counts_each_optimizer_s_step_as_lightning_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=2)
    fit = trainer(tmp_path, [monitor], max_steps=8)
    fit.fit(ConvGan(), images())
    assert fit.global_step == 8
    report = monitor.report
    assert report is not None and (report.steps, report.optimizer_steps) == (4, 8)
    capsys_out = capsys.readouterr().out
    console, markdown, page, _ = header_everywhere(tmp_path, capsys_out)
    assert console.endswith("(cpu), 8 optimizer steps (4 batches)")
    assert "; 8 optimizer steps (4 batches); " in markdown and "; 8 optimizer steps (4 batches); " in page
    # What a phase's peak is, where a batch ran two backward passes and two updates.
    assert "phase peaks (each the highest of its kind in a batch): forward " in capsys_out
    note = "The batches took 8 optimizer steps in 4 (manual optimization): each phase's peak is the highest"
    assert note in markdown and html.escape(note) in page


def test_a_run_resumed_from_a_state_without_the_count_says_steps_as_before() -> None:
    from lightning_vram.render.text import steps_text  # new with the count: the other tests fail alone on old code

    counted = MemoryTracker(recent_steps=4, peak_was_reset=True)
    for _ in range(3):
        counted.count_optimizer_step()
        counted.count_step()
    state = counted.state_dict()
    assert state["optimizer_steps"] == 3
    del state["optimizer_steps"]  # a checkpoint written before the count
    resumed = MemoryTracker(recent_steps=4, peak_was_reset=True)
    resumed.load_state_dict(state)
    resumed.count_optimizer_step()
    assert (resumed.steps, resumed.optimizer_steps) == (3, None)
    assert steps_text(resumed.steps, resumed.optimizer_steps, 2) == "3 steps"
