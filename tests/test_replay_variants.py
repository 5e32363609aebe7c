"""Each change replayed on a run's step against the same change applied for real and measured by the monitor.

The issue's bar: a replayed prediction within 10% of what the monitor counts when the change is made. On the CPU the
monitor's peak of a phase is the sum of its counted parts, so each phase's parts are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import OPTIMIZERS, Classifier
from replay_models import ARCHITECTURES, CausalLM, counted_step, lstm, mlp, resnet
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import (
    Attribution,
    BatchSizeChange,
    CheckpointChange,
    CheckpointPlan,
    FreeGradientsChange,
    InplaceChange,
    Phase,
    PrecisionChange,
    ReplayedStep,
    StepChange,
)

# Each change replayed as a variant of the step.
pytestmark = pytest.mark.replay

WITHIN = 0.10
"""A replayed change's counted bytes must be within 10% of the measured ones (the issue's "Done when")."""


def assert_close(replayed: ReplayedStep, measured: Attribution) -> None:
    for phase, counted in measured.phases.items():
        breakdown = replayed.phases[phase].breakdown
        assert breakdown is not None
        assert abs(breakdown.counted_bytes - counted.counted_bytes) <= WITHIN * counted.counted_bytes, phase
        assert abs(breakdown.activations - counted.activations) <= WITHIN * max(counted.activations, 1), phase


class SequentialCheckpoints(Classifier):
    """Runs its nn.Sequential through checkpoint_sequential, as the checkpointing advice's snippet says."""

    def __init__(self, network: nn.Sequential, segments: int) -> None:
        super().__init__(network, OPTIMIZERS["adam"])
        self.segments = segments

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.network, self.segments, inputs, use_reentrant=False)  # type: ignore[no-any-return]


class FreeGradients(pl.Callback):
    """Sets the gradients to None at batch start (before the monitor's own hook)."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)


def inplace_mlp() -> Classifier:
    network = mlp()
    for module in network:
        if isinstance(module, nn.ReLU):
            module.inplace = True
    return Classifier(network, OPTIMIZERS["adam"])


def checkpointed_gpt2() -> CausalLM:
    module = CausalLM()
    module.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return module


class CheckpointedLstm(Classifier):
    """The LSTM of ``lstm()`` run as ``checkpoint(self.network[1], x)``, as the advice's snippet for a unit says."""

    def __init__(self) -> None:
        super().__init__(lstm(), OPTIMIZERS["adam"])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        embedding, recurrent, last, head = self.network
        hidden = checkpoint(recurrent, embedding(inputs), use_reentrant=False)
        return head(last(hidden))  # type: ignore[no-any-return]


LSTM_UNIT = CheckpointPlan("network", (("network.1",),), None, 0, "network")
"""A plan whose unit is one recurrent module: backward recomputes all of it at once (little to save)."""

GPT2_BLOCKS = CheckpointPlan(
    "model.transformer.h",
    (("model.transformer.h.0",), ("model.transformer.h.1",)),
    None,
    0,
    "model.transformer",
)

# name, architecture, the change, the model with the change made for real, extra Trainer options, batch size.
CASES: list[tuple[str, str, StepChange, Callable[[], pl.LightningModule], dict[str, Any], int | None]] = [
    ("bf16-mixed gpt2", "gpt2", PrecisionChange("bf16-mixed"), CausalLM, {"precision": "bf16-mixed"}, None),
    (
        "bf16-mixed resnet",
        "resnet",
        PrecisionChange("bf16-mixed"),
        lambda: Classifier(resnet(), OPTIMIZERS["sgd_momentum"]),
        {"precision": "bf16-mixed"},
        None,
    ),
    (
        "bf16-true mlp",
        "mlp",
        PrecisionChange("bf16-true"),
        lambda: Classifier(mlp(), OPTIMIZERS["adam"]),
        {"precision": "bf16-true"},
        None,
    ),
    (
        "checkpoint_sequential mlp",
        "mlp",
        CheckpointChange(CheckpointPlan("network", (), 2, 0, "")),
        lambda: SequentialCheckpoints(mlp(), 2),
        {},
        None,
    ),
    ("checkpoint gpt2 blocks", "gpt2", CheckpointChange(GPT2_BLOCKS), checkpointed_gpt2, {}, None),
    # Backward recomputes the checkpointed LSTM whole: the replay must count what that recomputation keeps.
    ("checkpoint lstm unit", "lstm", CheckpointChange(LSTM_UNIT), CheckpointedLstm, {}, None),
    ("inplace mlp", "mlp", InplaceChange(("network.1", "network.3", "network.5")), inplace_mlp, {}, None),
    (
        "free gradients encoder",
        "encoder",
        FreeGradientsChange(),
        ARCHITECTURES["encoder"].build,
        {"callbacks": (FreeGradients(),)},
        None,
    ),
    ("batch x4 lstm", "lstm", BatchSizeChange(32), ARCHITECTURES["lstm"].build, {}, 32),
    ("batch x2 gpt2", "gpt2", BatchSizeChange(8), CausalLM, {}, 8),
]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pl.LightningModule, Any]]:
    """Each architecture the cases change, trained as it is: (module, batch)."""
    runs = {}
    for name in {case[1] for case in CASES}:
        architecture = ARCHITECTURES[name]
        torch.manual_seed(0)
        module = architecture.build()
        _, batch = counted_step(tmp_path_factory.mktemp(name), module, architecture.data(64), architecture.batch_size)
        runs[name] = (module, batch)
    return runs


@pytest.mark.parametrize(
    ("architecture", "change", "build", "options", "batch_size"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_replayed_change_matches_the_change_made_for_real(
    tmp_path: Path,
    baselines: dict[str, tuple[pl.LightningModule, Any]],
    architecture: str,
    change: StepChange,
    build: Callable[[], pl.LightningModule],
    options: dict[str, Any],
    batch_size: int | None,
) -> None:
    module, batch = baselines[architecture]
    replayed = Predictor(module, module.trainer.optimizers, batch).replay(change)
    assert isinstance(replayed, ReplayedStep), replayed
    torch.manual_seed(0)
    spec = ARCHITECTURES[architecture]
    size = batch_size or spec.batch_size
    measured, _ = counted_step(tmp_path, build(), spec.data(max(64, 2 * size)), size, **options)
    assert_close(replayed, measured)


def test_changes_move_the_parts_they_should(baselines: dict[str, tuple[pl.LightningModule, Any]]) -> None:
    module, batch = baselines["mlp"]
    optimizers = module.trainer.optimizers
    predictor = Predictor(module, optimizers, batch)
    plain = predictor.baseline()
    freed = predictor.replay(FreeGradientsChange())
    true16 = predictor.replay(PrecisionChange("bf16-true"))
    mixed = predictor.replay(PrecisionChange("bf16-mixed"))
    half = predictor.replay(PrecisionChange("16-mixed"))
    assert all(isinstance(result, ReplayedStep) for result in (plain, freed, true16, mixed, half))
    assert isinstance(plain, ReplayedStep) and isinstance(freed, ReplayedStep) and isinstance(true16, ReplayedStep)
    assert isinstance(mixed, ReplayedStep) and isinstance(half, ReplayedStep)
    before, after = plain.phases[Phase.FORWARD].breakdown, freed.phases[Phase.FORWARD].breakdown
    assert before is not None and after is not None
    assert after.gradients == 0 and before.gradients == before.parameters
    assert freed.phases[Phase.FORWARD].peak_bytes < plain.phases[Phase.FORWARD].peak_bytes
    cast = true16.phases[Phase.FORWARD].breakdown
    assert cast is not None and 2 * cast.parameters == before.parameters  # bfloat16 weights: half the bytes
    # CPU autocast lowers the same ops to float16 as to bfloat16: the same bytes saved.
    assert mixed.phases[Phase.FORWARD].breakdown == half.phases[Phase.FORWARD].breakdown
    assert mixed.precision == "bf16-mixed" and half.precision == "16-mixed"
