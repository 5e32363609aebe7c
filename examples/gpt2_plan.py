"""GPT-2-class LightningModules for ``lightning-vram plan`` (``transformers``' ``GPT2LMHeadModel``, language modelling).

``SmallGPT2``: 4 layers of width 256 (GPT-2's vocabulary), built on the CPU::

    lightning-vram plan examples/gpt2_plan.py:SmallGPT2 --batch "int64[8,256]"

``GPT2OnMeta``: GPT-2 124M (12 layers, width 768) built on the meta device, where no memory of its size is
allocated::

    lightning-vram plan examples/gpt2_plan.py:GPT2OnMeta --batch "int64[8,1024]"
"""

from __future__ import annotations

import lightning as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel


class SmallGPT2(L.LightningModule):
    """GPT-2 with ``layers`` layers of width ``width`` and ``positions`` positions; the batch is token ids."""

    def __init__(self, layers: int = 4, width: int = 256, heads: int = 4, positions: int = 256) -> None:
        super().__init__()
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=positions)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class GPT2OnMeta(SmallGPT2):
    """GPT-2 124M built on the meta device: its parameters hold no memory."""

    def __init__(self) -> None:
        with torch.device("meta"):
            super().__init__(layers=12, width=768, heads=12, positions=1024)
