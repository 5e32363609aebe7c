"""The chunked-loss advice on a masked language model: its printed code, as printed, computes the model's own loss.

A trial's tiny BERT masked LM (labels -100 except at the masked 15%) was advised the chunked loss with code whose
only transformers example was a causal LM's (``model.model``, the targets shifted by one: for a masked LM another
objective) and whose helper divided the summed loss by every target, -100 included (a loss 1/0.15 times too small,
its gradients as much, unless the user rewrote the line its comment pointed at). The helper now divides by the
targets counted, as cross-entropy's mean does, and the code shows a masked LM's lines beside a causal LM's.
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

VOCAB, LENGTH, BATCH = 8000, 64, 8


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=LENGTH, attn_implementation="eager",
    )  # fmt: skip
    return BertForMaskedLM(config)


def _data(samples: int) -> TensorDataset:
    """Token ids, an attention mask, and labels: the token at 15% of the positions, -100 (ignored) elsewhere."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (samples, LENGTH), generator=generator)
    masked = torch.rand(ids.shape, generator=generator) < 0.15
    labels = ids.masked_fill(~masked, -100)
    return TensorDataset(ids.masked_fill(masked, 4), torch.ones_like(ids), labels)


class MaskedLM(pl.LightningModule):
    """BERT trained on its own loss, or (``usage``: the advice's lines) on the advice's chunked loss."""

    def __init__(self, helper: Any = None, usage: str | None = None) -> None:
        super().__init__()
        self.model = _bert()
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


def _report(root: Path, module: MaskedLM) -> Report:
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(_data(4 * BATCH), BATCH))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


def _printed(advice: Advice) -> tuple[Any, str]:
    """The advice's ``chunked_cross_entropy``, run as printed, and its masked LM's commented lines, uncommented."""
    block = re.search(r"```python\n(.*?)```", advice.detail, re.S)
    assert block is not None, advice.detail
    namespace: dict[str, Any] = {}
    exec(block.group(1), namespace)  # the advice's own code, as a user would paste it
    lines = block.group(1).splitlines()
    header = next((index for index, line in enumerate(lines) if line.startswith("# A masked LM")), None)
    # Before: no masked LM's lines (only a causal LM's, which shift the targets by one).
    assert header is not None, block.group(1)
    usage = [line.removeprefix("# ") for line in lines[header + 1 : header + 3]]
    assert usage[0].startswith("hidden =") and usage[1].startswith("loss ="), usage
    return namespace["chunked_cross_entropy"], "\n".join(usage)


@pytest.mark.replay  # the advice is read from a replayed step
def test_the_printed_chunked_loss_is_a_masked_lms_own_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = _report(tmp_path / "before", MaskedLM())
    advice = next((item for item in before.advice if item.id is AdviceId.CHUNKED_LOSS), None)
    assert advice is not None, [item.id for item in before.advice]
    helper, usage = _printed(advice)
    # The same loss, to float32 rounding, on one batch (dropout off).
    batch = next(iter(loader(_data(BATCH), BATCH)))
    torch.manual_seed(0)
    own = MaskedLM().eval().training_step(batch, 0)
    torch.manual_seed(0)
    chunked = MaskedLM(helper, usage).eval().training_step(batch, 0)
    # Before: the helper divided by every target, -100 included: about 0.15 of the model's loss.
    assert chunked.item() == pytest.approx(own.item(), rel=1e-5)
    # Trained as printed, the peak falls by the saving the advice gave (within 10%), and the advice is gone.
    torch.manual_seed(0)
    after = _report(tmp_path / "after", MaskedLM(helper, usage))
    assert before.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    realised = before.peak.peak_bytes - after.peak.peak_bytes
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert AdviceId.CHUNKED_LOSS not in {item.id for item in after.advice}
