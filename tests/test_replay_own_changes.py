"""A replay's notes of what the replayed code changed name the user's objects only.

A plan that checkpoints a module puts the library's wrapper in its place (its own ``calls`` list, the user's module
as its ``first``), and FSDP2's sharding of the replay's copy sets an ``nn.LSTM``'s parameters through its
``__setattr__``, which torch mirrors into the module's ``_flat_weights``. Neither is the user's code changing its
objects: no note names them. A ``training_step`` that does change its own list is still noted, by the user's path,
and put back; and the user's LSTM keeps its own parameters in ``_flat_weights``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_vram import plan
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import CheckpointChange, CheckpointPlan, ReplayedStep

pytestmark = pytest.mark.replay

VOCABULARY = 50
TOOL_NAMES = ("calls", "first", "_flat_weights")
"""What the library's wrapper and torch's mirror of an LSTM's parameters are called: never in a note."""
CHECKPOINT_LSTM = CheckpointChange(CheckpointPlan("", (("lstm",),), None, 0))


class LSTMLanguageModel(pl.LightningModule):
    """The user's report, smaller: an embedding, a two-layer LSTM with dropout, a linear head, Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCABULARY, 8)
        self.lstm = nn.LSTM(8, 16, num_layers=2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, VOCABULARY)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        hidden, _ = self.lstm(self.emb(tokens))
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), 1e-3)


class CountingCalls(LSTMLanguageModel):
    """Appends to a list of its own named as the wrapper's is: a change of the user's code."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append(batch_idx)
        return super().training_step(batch, batch_idx)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCABULARY, (4, 8), generator=generator)
    return inputs, torch.randint(0, VOCABULARY, (4, 8), generator=generator)


def flat_weights_are_the_parameters(lstm: nn.LSTM) -> bool:
    names = lstm._flat_weights_names
    return all(weight is getattr(lstm, name) for weight, name in zip(lstm._flat_weights, names, strict=True))


def tool_notes(notes: tuple[str, ...]) -> list[str]:
    return [note for note in notes if any(name in note for name in TOOL_NAMES)]


def test_a_plan_checkpointing_and_sharding_the_lstm_notes_none_of_the_librarys_changes() -> None:
    torch.manual_seed(0)
    module = LSTMLanguageModel()
    parameters = list(module.parameters())
    state = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    result = plan(
        module,
        tokens(),
        gpus=["H100 SXM"],
        world_sizes=(1, 2),
        strategies=("fsdp2",),
        precisions=("32-true",),
        budget_seconds=120.0,
    )
    assert not result.left_out
    assert {(row.strategy, row.checkpointing) for row in result.rows} == {
        (strategy, checkpointing) for strategy in ("single", "fsdp2") for checkpointing in (False, True)
    }
    assert tool_notes(result.notes) == []
    assert flat_weights_are_the_parameters(module.lstm)
    assert all(mine is theirs for mine, theirs in zip(module.parameters(), parameters, strict=True))
    assert all(torch.equal(tensor, state[name]) for name, tensor in module.state_dict().items())


def test_a_replay_checkpointing_the_lstm_notes_nothing() -> None:
    torch.manual_seed(0)
    module = LSTMLanguageModel()
    with round_of_replays():
        step = Predictor(module, None, tokens()).replay(CHECKPOINT_LSTM)
    assert isinstance(step, ReplayedStep)
    assert [note for note in step.notes if "put back" in note] == []
    assert flat_weights_are_the_parameters(module.lstm)


def test_a_step_changing_its_own_list_is_noted_and_put_back_beside_the_checkpointed_lstm() -> None:
    torch.manual_seed(0)
    module = CountingCalls()
    predictor = Predictor(module, None, tokens())
    with round_of_replays():
        baseline, checkpointed = predictor.replay(), predictor.replay(CHECKPOINT_LSTM)
    note = "the replayed code changed the model.calls (a list); put back as it was"
    for step in (baseline, checkpointed):
        assert isinstance(step, ReplayedStep)
        assert [line for line in step.notes if "put back" in line] == [note]
    assert module.calls == []
