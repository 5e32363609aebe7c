"""The chunked-loss advice on a masked language model: its printed code, as printed, computes the model's own loss.

A trial's tiny BERT masked LM (labels -100 except at the masked 15%) was advised the chunked loss with code whose
only transformers example was a causal LM's (``model.model``, the targets shifted by one: for a masked LM another
objective) and whose helper divided the summed loss by every target, -100 included (a loss 1/0.15 times too small,
its gradients as much, unless the user rewrote the line its comment pointed at). The helper now divides by the
targets counted, as cross-entropy's mean does, and the code shows a masked LM's lines beside a causal LM's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chunked_loss_printed import check_printed_loss
from torch.utils.data import TensorDataset

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


@pytest.mark.replay  # the advice is read from a replayed step
def test_the_printed_chunked_loss_is_a_masked_lms_own_loss(tmp_path: Path) -> None:
    # Before: the helper divided by every target, -100 included: about 0.15 of the model's loss.
    check_printed_loss(tmp_path, _bert, _data(4 * BATCH), BATCH, "# A masked LM", "hidden =")
