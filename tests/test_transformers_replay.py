"""The replay takes the real step's branches on transformers models: every counted part within 1% of the real step.

Under fake tensors transformers used to take its tracing branch (a full attention mask; grouped-query key/value heads
repeated), so the replay over-counted attention and its baseline was rejected on Qwen2 and Mistral.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from replay_models import counted_step
from torch import nn
from torch.utils.data import TensorDataset
from transformers_models import ARCHITECTURES, FineTuned, data

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import ReplayedStep, ReplaySkipped

# transformers models replayed.
pytestmark = pytest.mark.replay

pytest.importorskip("transformers")


def _simulated(root: Path, kind: str, length: int, padded: bool = False) -> Any:
    torch.manual_seed(0)
    module = FineTuned(kind, length)
    attribution, batch = counted_step(root, module, data(kind, length, padded=padded), batch_size=2)
    return Predictor(module, module.trainer.optimizers, batch, calibration=attribution).simulate()


@pytest.mark.parametrize("length", [32, 96])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_every_part_of_the_replayed_step_is_within_one_percent(tmp_path: Path, kind: str, length: int) -> None:
    simulation = _simulated(tmp_path, kind, length)
    assert simulation.skipped is None and simulation.match is not None, simulation.skipped
    assert simulation.match.matches, simulation.match.worst
    assert len(simulation.match.parts) == 15  # 3 phases x (4 counted parts + the live peak)
    assert max(part.relative_error for part in simulation.match.parts) <= 0.01


@pytest.mark.parametrize("kind", ["llama", "qwen2", "bert", "t5"])
def test_a_padded_batch_replays_the_mask_the_real_step_builds(tmp_path: Path, kind: str) -> None:
    simulation = _simulated(tmp_path, kind, 64, padded=True)
    assert simulation.skipped is None and simulation.match is not None, simulation.skipped
    assert simulation.match.matches, simulation.match.worst


class ReadsItsBatch(pl.LightningModule):
    """A step that reads values of its batch: the longest sequence (``.item()``) and whether any is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, mask = batch
        longest = int(mask.sum(dim=1).max().item())
        tokens = tokens[:, :longest]
        hidden = self.embedding(tokens)
        if not bool(mask[:, :longest].all()):
            hidden = hidden * mask[:, :longest, None]
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def _reads_its_batch_data() -> TensorDataset:
    tokens = torch.randint(0, 50, (8, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 24, dtype=torch.long)
    mask[:, 20:] = 0  # every sample is 20 tokens long: the step cuts the batch to 20
    return TensorDataset(tokens, mask)


def test_a_step_that_reads_its_batch_values_replays_with_the_real_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = ReadsItsBatch()
    attribution, batch = counted_step(tmp_path, module, _reads_its_batch_data(), batch_size=4)
    simulation = Predictor(module, module.trainer.optimizers, batch, calibration=attribution).simulate()
    assert simulation.skipped is None and simulation.match is not None, simulation.skipped
    assert simulation.match.matches, simulation.match.worst


class ReadsAWeight(ReadsItsBatch):
    """A step whose Python branches on a value computed from the model's weights: no replay can know it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, _mask = batch
        hidden = self.embedding(tokens)
        if hidden.mean() > 0:
            hidden = hidden * 2
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), tokens.flatten())


def test_a_value_computed_from_the_weights_still_skips_the_replay_saying_why() -> None:
    module = ReadsAWeight()
    tokens, mask = _reads_its_batch_data()[0:4]
    replayed = Predictor(module, [torch.optim.Adam(module.parameters())], (tokens, mask), warm_up=True).baseline()
    assert isinstance(replayed, ReplaySkipped)
    assert "reads a tensor's value" in replayed.reason


def test_transformers_own_tracing_check_is_put_back_after_the_replay() -> None:
    import_utils = sys.modules["transformers.utils.import_utils"]
    before = import_utils.is_fake_tensor
    module = FineTuned("llama", 16)
    tokens, mask = data("llama", 16)[0:2]
    replayed = Predictor(module, [torch.optim.AdamW(module.parameters())], (tokens, mask), warm_up=True).baseline()
    assert isinstance(replayed, ReplayedStep)
    assert import_utils.is_fake_tensor is before
    failing = Predictor(ReadsAWeight(), None, (tokens % 50, mask), warm_up=True).baseline()
    assert isinstance(failing, ReplaySkipped)
    assert import_utils.is_fake_tensor is before


def test_a_checkpointed_variant_that_fails_in_backward_leaves_no_fake_tensor_behind(tmp_path: Path) -> None:
    """Llama's cache doubles when a wrapped layer is recomputed: the variant fails in backward, and must let go."""
    from lightning_vram.advice.checkpointing import checkpoint_candidates
    from lightning_vram.prediction.containment.escapes import check_no_escape, forget
    from lightning_vram.records import CheckpointChange

    torch.manual_seed(0)
    module = FineTuned("llama", 32)
    attribution, batch = counted_step(tmp_path, module, data("llama", 32, padded=True), batch_size=2)
    forget()
    plan = checkpoint_candidates(attribution.modules)[0]
    replayed = Predictor(module, module.trainer.optimizers, batch).replay(CheckpointChange(plan))
    assert isinstance(replayed, ReplaySkipped) and "broadcast" in replayed.reason
    check_no_escape()  # raises ReplayEscapeError when the failed recomputation kept the replay's copy


@pytest.mark.parametrize("kind", ["qwen2", "bert"])
def test_the_longest_length_predicted_from_a_short_batch_equals_a_long_batch(kind: str) -> None:
    """Stretched to max_length, the batch keeps real values (a mask of ones): the replay takes the real branch."""
    from lightning_vram.predict import predict

    torch.manual_seed(0)
    module = FineTuned(kind, 96)
    short = tuple(tensor.clone() for tensor in data(kind, 32)[0:2])  # clones: a dataset's slice holds all its rows
    long = tuple(tensor.clone() for tensor in data(kind, 96)[0:2])
    stretched = predict(module, short, device_type="cpu", fit_table=False, max_length=96)
    real = predict(module, long, device_type="cpu", fit_table=False)
    assert stretched.step is not None and real.step is not None
    assert stretched.step.peak.peak_bytes == real.step.peak.peak_bytes
