"""The chunked-loss advice on an encoder-decoder (T5): its printed code, as printed, computes the model's own loss.

A trial's tiny T5 (``T5ForConditionalGeneration``, trained on ``model(..., labels=labels).loss``, its layers
checkpointed as advised) was advised the chunked loss with code whose transformers examples were a causal LM's
(``model.model``, the targets shifted by one) and a masked LM's (``model.bert``): neither is a seq2seq model's body,
whose decoder reads the labels shifted right and whose output T5 scales by ``model_dim**-0.5`` before its head (the
obvious port, the decoder's output straight into ``lm_head``, computes another loss). The code now shows an
encoder-decoder's lines beside them; pasted as printed, they give T5's own loss and the saving the advice promised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chunked_loss_printed import check_printed_loss
from torch.utils.data import TensorDataset

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


@pytest.mark.replay  # the advice is read from a replayed step
def test_the_printed_chunked_loss_is_an_encoder_decoders_own_loss(tmp_path: Path) -> None:
    # Without T5's scaling of the decoder's output the loss is another (25.14 against T5's 9.48 here).
    check_printed_loss(tmp_path, _t5, _data(4 * BATCH), BATCH, "# An encoder-decoder", "encoded =")
