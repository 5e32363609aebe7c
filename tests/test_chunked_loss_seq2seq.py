"""The chunked-loss advice on an encoder-decoder (T5): its printed code, as printed, computes the model's own loss.

A trial's tiny T5 (``T5ForConditionalGeneration``, trained on ``model(..., labels=labels).loss``, its layers
checkpointed as advised) was advised the chunked loss with code whose transformers examples were a causal LM's
(``model.model``, the targets shifted by one) and a masked LM's (``model.bert``): neither is a seq2seq model's body,
whose decoder reads the labels shifted right and whose output T5 scales by ``model_dim**-0.5`` before its head (the
obvious port, the decoder's output straight into ``lm_head``, computes another loss). The code now shows an
encoder-decoder's lines beside them; pasted as printed, they give T5's own loss and the saving the advice promised.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import loader, trainer
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.records import Advice, AdviceId

pytest.importorskip("transformers")

VOCAB, SOURCE, TARGET, BATCH = 8000, 16, 64, 8


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def _data(samples: int) -> TensorDataset:
    """Source ids, their attention mask (the last quarter padding in every other sample), and target labels."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (samples, SOURCE), generator=generator)
    mask = torch.ones_like(ids)
    mask[::2, -SOURCE // 4 :] = 0
    labels = torch.randint(2, VOCAB, (samples, TARGET), generator=generator)
    labels[1::2, -TARGET // 8 :] = -100  # no loss taken there
    return TensorDataset(ids, mask, labels)


class Seq2Seq(pl.LightningModule):
    """T5 trained on its own loss, or (``usage``: the advice's lines) on the advice's chunked loss."""

    def __init__(self, helper: Any = None, usage: str | None = None) -> None:
        super().__init__()
        self.model = _t5()
        self.helper, self.usage = helper, usage

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, mask, labels = batch
        if self.usage is None:
            own: Tensor = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            return own
        namespace = {"model": self.model, "ids": ids, "mask": mask, "labels": labels}
        namespace["chunked_cross_entropy"] = self.helper
        exec(self.usage, namespace)  # the advice's own lines, as a user would paste them
        chunked: Tensor = namespace["loss"]
        return chunked

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _report(root: Path, module: Seq2Seq) -> Report:
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(_data(4 * BATCH), BATCH))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


def _printed(advice: Advice) -> tuple[Any, str]:
    """The advice's ``chunked_cross_entropy``, run as printed, and its encoder-decoder's code lines, uncommented."""
    block = re.search(r"```python\n(.*?)```", advice.detail, re.S)
    assert block is not None, advice.detail
    namespace: dict[str, Any] = {}
    exec(block.group(1), namespace)  # the advice's own code, as a user would paste it
    lines = block.group(1).splitlines()
    header = next((index for index, line in enumerate(lines) if line.startswith("# An encoder-decoder")), None)
    # Before: no encoder-decoder's lines (only a causal LM's and a masked LM's).
    assert header is not None, block.group(1)
    start = next(index for index in range(header, len(lines)) if lines[index].startswith("# encoded ="))
    end = next(index for index in range(start, len(lines)) if lines[index].startswith("# loss ="))
    usage = [line.removeprefix("# ") for line in lines[start : end + 1]]
    return namespace["chunked_cross_entropy"], "\n".join(usage)


@pytest.mark.replay  # the advice is read from a replayed step
def test_the_printed_chunked_loss_is_an_encoder_decoders_own_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = _report(tmp_path / "before", Seq2Seq())
    advice = next((item for item in before.advice if item.id is AdviceId.CHUNKED_LOSS), None)
    assert advice is not None, [item.id for item in before.advice]
    helper, usage = _printed(advice)
    # The same loss, to float32 rounding, on one batch (labels -100 where no loss is taken, padded sources).
    batch = next(iter(loader(_data(BATCH), BATCH)))
    torch.manual_seed(0)
    own = Seq2Seq().training_step(batch, 0)
    torch.manual_seed(0)
    chunked = Seq2Seq(helper, usage).training_step(batch, 0)
    # Without T5's scaling of the decoder's output the loss is another (25.14 against T5's 9.48 here).
    assert chunked.item() == pytest.approx(own.item(), rel=1e-5)
    # Trained as printed, the peak falls by the saving the advice gave (within 10%), and the advice is gone.
    torch.manual_seed(0)
    after = _report(tmp_path / "after", Seq2Seq(helper, usage))
    assert before.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    realised = before.peak.peak_bytes - after.peak.peak_bytes
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert AdviceId.CHUNKED_LOSS not in {item.id for item in after.advice}
