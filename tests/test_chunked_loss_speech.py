"""The chunked-loss advice on a speech encoder-decoder (Whisper): its printed code, as printed, computes its own loss.

A new user's trial (the fourteenth session) trained a tiny ``WhisperForConditionalGeneration`` from its config on
``model(input_features=..., labels=...).loss`` and was advised the chunked loss with an encoder-decoder's lines written
for T5 and BART: each of their three calls fails on Whisper (its encoder takes ``input_features``, not ``input_ids``:
TypeError; it has no ``prepare_decoder_input_ids_from_labels`` and no ``lm_head``: AttributeError, its head is
``proj_out``). The code now shows a speech encoder-decoder's lines; pasted as printed, they give Whisper's own loss
(9.036040306 both, on the trial's batch) and the saving the advice promised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chunked_loss_printed import check_printed_loss
from torch.utils.data import TensorDataset

pytest.importorskip("transformers")

VOCAB, MELS, FRAMES, TARGET, BATCH = 8000, 16, 32, 64, 8


def _whisper() -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=FRAMES // 2, max_target_positions=TARGET, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, dropout=0.0,
    )  # fmt: skip
    return WhisperForConditionalGeneration(config)


def _data(samples: int) -> TensorDataset:
    """Log-mel features, an unused mask (the batch's shape as the text models' tests have it), and target labels."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, MELS, FRAMES, generator=generator)
    labels = torch.randint(3, VOCAB, (samples, TARGET), generator=generator)
    labels[1::2, -TARGET // 8 :] = -100  # no loss taken there
    return TensorDataset(features, torch.ones_like(labels), labels)


@pytest.mark.replay  # the advice is read from a replayed step
def test_the_printed_chunked_loss_is_a_speech_encoder_decoders_own_loss(tmp_path: Path) -> None:
    check_printed_loss(
        tmp_path, _whisper, _data(4 * BATCH), BATCH, "# A speech encoder-decoder", "from transformers", features=True
    )
