"""``max_length``'s predicted peak, where the first batch has no padding and later batches have.

Preflight resizes the first batch to ``max_length``, tiling its values. A new user's trial (the fourteenth session)
trained a GPT-NeoX model whose first batch held no padding (an attention mask of ones, for which transformers builds
no attention mask) under ``max_length=512``: the report predicted 132.2 MiB at 512 tokens, where its padded batches
of 512 measured 148.2 MiB. A worst batch replayed later is now replayed at the longest length too, and the predicted
row keeps the higher peak.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import trainer
from torch.utils.data import DataLoader

from lightning_vram import Report, VramMonitor

pytest.importorskip("transformers")

VOCAB, SHORT, BATCH, LONGEST = 500, 8, 4, 64


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        config = GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=LONGEST, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        self.model = GPTNeoXForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask = batch
        labels = ids.masked_fill(mask == 0, -100)
        loss: torch.Tensor = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples padded (0) to the batch's longest, with their attention mask."""
    longest = max(len(sample) for sample in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)], mask[row, : len(sample)] = sample, 1
    return ids, mask


def _report(root: Path, long: int, max_length: int | None) -> Report:
    """Two batches of short samples (no padding), then one of a ``long`` sample beside short ones (padded)."""
    generator = torch.Generator().manual_seed(0)
    lengths = [SHORT] * (2 * BATCH) + [long] + [SHORT] * (BATCH - 1)
    samples = [torch.randint(1, VOCAB, (length,), generator=generator) for length in lengths]
    loader = DataLoader(samples, batch_size=BATCH, collate_fn=_collate)  # type: ignore[arg-type]
    torch.manual_seed(0)
    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=None, console_summary=False, max_length=max_length
    )
    trainer(root, [monitor], max_steps=3).fit(CausalLM(), loader)
    assert monitor.report is not None and monitor.report.shapes is not None
    return monitor.report


@pytest.mark.replay  # the lengths' peaks are replayed
def test_the_longest_length_is_predicted_as_padded_batches_reach_it(tmp_path: Path) -> None:
    predicted = _report(tmp_path / "predicted", long=LONGEST * 3 // 4, max_length=LONGEST)
    assert predicted.shapes is not None
    (row,) = [row for row in predicted.shapes.lengths if row.step is None]
    assert row.length == LONGEST
    reached = _report(tmp_path / "reached", long=LONGEST, max_length=None)
    assert reached.shapes is not None
    (measured,) = [row for row in reached.shapes.lengths if row.length == LONGEST]
    assert measured.step == 2  # the padded batch at the longest length, replayed as measured
    # Before: the first batch's values (no padding) tiled to 64 tokens, a peak lower than the padded batch's.
    assert row.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.01), (row.peak_bytes, measured.peak_bytes)
