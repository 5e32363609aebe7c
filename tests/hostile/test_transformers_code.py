"""Real transformer code (rotary caches, SDPA, the library's own caches and checks) trains untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, Case, assert_untouched
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")


class CausalLM(pl.LightningModule):
    """A tiny Llama (rotary position embeddings, grouped-query attention through SDPA) from its config class."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss: torch.Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("path", PATHS)
def test_a_llama_with_rotary_caches_and_sdpa_trains_untouched(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        tokens = torch.randint(0, 64, (16, 24), generator=torch.Generator().manual_seed(0))
        return Case(CausalLM(), DataLoader(TensorDataset(tokens), batch_size=4))

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped


LENGTHS_SEEN: list[int] = []
"""A module-level list the step appends to: the user's own object, outside the model."""


class PaddedCausalLM(CausalLM):
    """Reads its batch's values (the tokens per batch, as Python ints) and keeps them, in itself and in a global."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens_per_batch: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, mask = batch
        counted = int(mask.sum().item())
        self.tokens_per_batch.append(counted)
        LENGTHS_SEEN.append(counted)
        longest = int(mask.sum(dim=1).max())
        loss: torch.Tensor = self.model(
            input_ids=tokens[:, :longest], attention_mask=mask[:, :longest], labels=tokens[:, :longest]
        ).loss
        return loss


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_reads_its_padded_batch_trains_untouched_and_is_replayed(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        LENGTHS_SEEN.clear()
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (16, 24), generator=generator)
        mask = torch.ones(16, 24, dtype=torch.long)
        mask[1::2, 12:] = 0
        mask[::4, 20:] = 0
        module = PaddedCausalLM()
        return Case(
            module,
            DataLoader(TensorDataset(tokens, mask), batch_size=4),
            observe=lambda: (list(module.tokens_per_batch), list(LENGTHS_SEEN)),
        )

    monitor = assert_untouched(build, tmp_path, path, attribution_every_n_steps=1)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
    assert simulation.match is not None and simulation.match.matches, simulation.match and simulation.match.worst
