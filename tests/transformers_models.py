"""The architectures people fine-tune, built from transformers' config classes (tiny, random weights, no download).

Each is a LightningModule whose batch is ``(input_ids, attention_mask)`` (``(pixel_values, labels)`` for ViT).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

VOCAB = 1000
LANGUAGE_MODELS = ("llama", "qwen2", "mistral", "bert", "t5", "gpt2")
"""Language models: causal (Llama; Qwen2 and Mistral with grouped-query attention; GPT-2), masked (BERT), T5."""
ARCHITECTURES = (*LANGUAGE_MODELS, "vit")


def build(kind: str, length: int = 64) -> torch.nn.Module:
    """A two-layer, 64-wide model of ``kind`` (``length``: the image side for ViT, else the longest sequence)."""
    import transformers as t

    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
    }
    builders = {
        "llama": partial(t.LlamaForCausalLM, t.LlamaConfig(**common, num_key_value_heads=4)),
        "qwen2": partial(t.Qwen2ForCausalLM, t.Qwen2Config(**common, num_key_value_heads=2)),
        "mistral": partial(t.MistralForCausalLM, t.MistralConfig(**common, num_key_value_heads=2)),
        "bert": partial(t.BertForMaskedLM, t.BertConfig(**common)),
        "gpt2": partial(
            t.GPT2LMHeadModel,
            t.GPT2Config(
                n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=1024, bos_token_id=0, eos_token_id=0
            ),
        ),
        "t5": partial(
            t.T5ForConditionalGeneration,
            t.T5Config(
                d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0
            ),
        ),
        "vit": partial(
            t.ViTForImageClassification,
            t.ViTConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                image_size=length,
                patch_size=4,
                num_labels=10,
            ),
        ),
    }
    model: torch.nn.Module = builders[kind]()
    return model


class FineTuned(pl.LightningModule):
    """A transformers model trained with AdamW on its own loss (``labels`` = the inputs, or the class for ViT)."""

    def __init__(self, kind: str, length: int = 64) -> None:
        super().__init__()
        self.kind = kind
        self.model = build(kind, length)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "vit":
            pixels, labels = batch
            loss: torch.Tensor = self.model(pixel_values=pixels, labels=labels).loss
        else:
            tokens, mask = batch
            loss = self.model(input_ids=tokens, attention_mask=mask, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(kind: str, length: int, samples: int = 16, padded: bool = False) -> TensorDataset:
    """Token ids and an attention mask (``padded``: every other sample's second half is padding); images for ViT."""
    generator = torch.Generator().manual_seed(0)
    if kind == "vit":
        return TensorDataset(
            torch.randn(samples, 3, length, length, generator=generator),
            torch.randint(0, 10, (samples,), generator=generator),
        )
    mask = torch.ones(samples, length, dtype=torch.long)
    if padded:
        mask[::2, length // 2 :] = 0
    return TensorDataset(torch.randint(0, VOCAB, (samples, length), generator=generator), mask)
