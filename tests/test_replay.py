"""The step replay under fake tensors: it reproduces the monitor's counted step, touches nothing, and says why not."""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import OPTIMIZERS, Classifier
from replay_models import ARCHITECTURES, CausalLM, counted_step, text
from torch import nn

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import (
    Attribution,
    Breakdown,
    CheckpointChange,
    CheckpointPlan,
    ModuleProfile,
    Phase,
    PrecisionChange,
    ReplayedStep,
    ReplaySkipped,
)

# The replay of the step under fake tensors.
pytestmark = pytest.mark.replay

FLOAT32 = 4


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pl.LightningModule, Attribution, Any]]:
    """Each architecture trained for three steps, the monitor counting step 1: (module, counts, batch)."""
    runs = {}
    for name, architecture in ARCHITECTURES.items():
        torch.manual_seed(0)
        module = architecture.build()
        attribution, batch = counted_step(
            tmp_path_factory.mktemp(name), module, architecture.data(64), architecture.batch_size
        )
        runs[name] = (module, attribution, batch)
    return runs


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_baseline_reproduces_the_counted_step(
    name: str, counted: dict[str, tuple[pl.LightningModule, Attribution, Any]]
) -> None:
    module, attribution, batch = counted[name]
    simulation = Predictor(module, module.trainer.optimizers, batch, calibration=attribution).simulate()
    assert simulation.skipped is None and simulation.match is not None and simulation.baseline is not None
    assert simulation.match.matches, simulation.match.worst
    assert len(simulation.match.parts) == 15  # 3 phases x (4 counted parts + the live peak, counted on the CPU)
    assert all(part.relative_error <= 0.01 for part in simulation.match.parts)

    # What each module saved and passed on, as the monitor counted it on the real step.
    def profiles(modules: tuple[ModuleProfile, ...]) -> dict[str, tuple[int, ...]]:
        return {
            profile.name: (
                profile.activation_bytes,
                profile.input_bytes,
                profile.output_bytes,
                profile.input_saved_bytes,
                profile.output_saved_bytes,
                profile.input_saved_for_backward,
            )
            for profile in modules
        }

    assert profiles(simulation.baseline.modules) == profiles(attribution.modules)
    assert simulation.baseline.batch_size == ARCHITECTURES[name].batch_size
    for phase, peak in simulation.baseline.phases.items():  # the live peak holds at least the counted parts
        assert peak.breakdown is not None and peak.peak_bytes >= peak.breakdown.counted_bytes
        measured = attribution.phases[phase]  # on the CPU in bytes, as the sampled step's live count
        assert measured.other is not None and peak.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.001)


def _state(module: pl.LightningModule) -> dict[str, Any]:
    optimizer = module.trainer.optimizers[0]
    return {
        "parameters": copy.deepcopy(module.state_dict()),
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "training": module.training,
        "hooks": [len(child._forward_hooks) + len(child._forward_pre_hooks) for child in module.modules()],
    }


def _equal(left: Any, right: Any) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_equal(left[key], right[key]) for key in left)
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(_equal(a, b) for a, b in zip(left, right, strict=True))
    return bool(left == right)


@pytest.mark.parametrize("name", ["resnet", "gpt2"])
def test_replay_leaves_the_model_optimizer_gradients_and_rng_as_they_were(
    name: str, counted: dict[str, tuple[pl.LightningModule, Attribution, Any]]
) -> None:
    module, _, batch = counted[name]
    before = _state(module)
    for change in (None, PrecisionChange("bf16-true")):
        result = Predictor(module, module.trainer.optimizers, batch).replay(change)
        assert isinstance(result, ReplayedStep)
    after = _state(module)
    assert before.keys() == after.keys()
    for key in before:
        assert _equal(before[key], after[key]), key
    assert module.trainer is not None  # the copy dropped its Trainer, the module kept it


class ReadsLoss(Classifier):
    """Reads the loss's value in training_step, as a guard against divergence would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:
            raise RuntimeError("diverged")
        return loss


class MasksOutputs(Classifier):
    """Keeps only the positive outputs: a shape that depends on values the model computes (the batch's are known)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        outputs = self(inputs)
        return outputs[outputs > 0].sum()


class ManualOptimization(Classifier):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 10))
        self.automatic_optimization = False


def _small_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8), torch.randint(0, 10, (4,))


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (ReadsLoss(nn.Linear(8, 10)), "reads a tensor's value (.item()"),
        (MasksOutputs(nn.Linear(8, 10)), "output shape depends on the data"),
    ],
)
def test_a_step_fake_tensors_cannot_run_is_skipped_with_the_reason(module: Classifier, reason: str) -> None:
    result = Predictor(module, [module.configure_optimizers()], _small_batch()).baseline()
    assert isinstance(result, ReplaySkipped)
    assert reason in result.reason
    simulation = Predictor(module, [module.configure_optimizers()], _small_batch()).simulate()
    assert simulation.baseline is None and simulation.skipped == result.reason


def test_a_manual_step_that_calls_no_backward_replays_its_forward_pass_only() -> None:
    # Under manual optimization Lightning runs training_step alone: this one returns a loss and steps nothing.
    module = ManualOptimization()
    result = Predictor(module, [module.configure_optimizers()], _small_batch()).baseline()
    assert isinstance(result, ReplayedStep) and set(result.phases) == {Phase.FORWARD}


def test_a_baseline_that_does_not_match_is_not_trusted(
    counted: dict[str, tuple[pl.LightningModule, Attribution, Any]],
) -> None:
    module, attribution, batch = counted["mlp"]
    forward = attribution.phases[Phase.FORWARD]
    off = replace(forward, activations=int(forward.activations * 1.05))
    simulation = Predictor(
        module,
        module.trainer.optimizers,
        batch,
        calibration=replace(attribution, phases={**attribution.phases, Phase.FORWARD: off}),
    ).simulate([PrecisionChange("bf16-mixed")])
    assert simulation.match is not None and not simulation.match.matches
    worst = simulation.match.worst
    assert worst is not None and (worst.phase, worst.part) == (Phase.FORWARD, "activations")
    assert simulation.skipped is not None and "forward activations" in simulation.skipped
    assert simulation.variants == ()  # nothing is tried on a baseline that does not match


def test_a_checkpointing_plan_that_breaks_backward_is_discarded(
    counted: dict[str, tuple[pl.LightningModule, Attribution, Any]],
) -> None:
    module, attribution, batch = counted["resnet"]
    # The stem's ReLU(inplace=True) as a unit of its own: checkpoint keeps its input, which it then overwrites.
    breaking = CheckpointChange(CheckpointPlan("network", (("network.2",),), None, 0, "network"))
    # With the BatchNorm before it, the unit starts with an op that does not overwrite its input.
    working = CheckpointChange(CheckpointPlan("network", (("network.1", "network.2"),), None, 0, "network"))
    simulation = Predictor(module, module.trainer.optimizers, batch, calibration=attribution).simulate(
        [breaking, working]
    )
    assert simulation.skipped is None
    first, second = simulation.variants
    assert first.replayed is None and first.discarded is not None
    assert "modified by an inplace operation" in first.discarded
    assert second.discarded is None and second.replayed is not None


def test_changes_past_the_time_budget_are_discarded_saying_so(
    counted: dict[str, tuple[pl.LightningModule, Attribution, Any]],
) -> None:
    module, attribution, batch = counted["mlp"]
    # The budget's clock reads 1,000 s later after its first two readings (the start, the baseline's deadline):
    # the baseline replays within its deadline, and the change after it finds the budget spent.
    readings = iter([0.0, 0.0])
    simulation = Predictor(
        module,
        module.trainer.optimizers,
        batch,
        budget_seconds=10,
        clock=lambda: next(readings, 1000.0),
        calibration=attribution,
    ).simulate([PrecisionChange("bf16-mixed")])
    assert simulation.baseline is not None
    (variant,) = simulation.variants
    assert variant.replayed is None and variant.discarded == "not replayed: the replay budget ran out of 10 s first"


def test_the_budget_covers_the_baseline_too(counted: dict[str, tuple[pl.LightningModule, Attribution, Any]]) -> None:
    module, attribution, batch = counted["mlp"]
    simulation = Predictor(
        module, module.trainer.optimizers, batch, budget_seconds=0, calibration=attribution
    ).simulate([PrecisionChange("bf16-mixed")])
    assert simulation.baseline is None and simulation.variants == ()
    assert simulation.skipped is not None and "time budget ran out" in simulation.skipped


def test_the_loss_share_of_a_language_model_is_its_log_softmax_over_the_vocabulary(tmp_path: Path) -> None:
    vocabulary, batch_size, length = 4000, 4, 16
    torch.manual_seed(0)
    module = CausalLM(layers=1, vocab=vocabulary)
    tokens = (torch.randint(0, vocabulary, (batch_size, length)),)
    result = Predictor(module, None, tokens, warm_up=True).baseline()
    assert isinstance(result, ReplayedStep)
    # cross_entropy saves the log-probabilities: batch x positions x vocabulary float32 values.
    assert result.loss_activation_bytes == batch_size * length * vocabulary * FLOAT32
    assert result.loss_activation_share > 0.5
    small = Classifier(nn.Linear(8, 10), OPTIMIZERS["sgd"])
    classifier = Predictor(small, None, _small_batch(), warm_up=True).baseline()
    assert isinstance(classifier, ReplayedStep) and classifier.loss_activation_bytes == 4 * 10 * FLOAT32


def test_replay_counts_parameters_gradients_and_adam_state_by_hand() -> None:
    module = Classifier(nn.Linear(32, 10), OPTIMIZERS["adam"])
    result = Predictor(module, None, (torch.randn(8, 32), torch.randint(0, 10, (8,))), warm_up=True).baseline()
    assert isinstance(result, ReplayedStep)
    parameters = (32 * 10 + 10) * FLOAT32
    # Adam: exp_avg and exp_avg_sq per parameter tensor, and a float32 step counter for each of the two tensors.
    state = 2 * parameters + 2 * FLOAT32
    forward = result.phases[Phase.FORWARD].breakdown
    assert forward == Breakdown(parameters, parameters, state, forward.activations, forward.other)
    # The Linear's input, cross-entropy's log-probabilities, its int64 targets and nll_loss's float32 total weight.
    assert forward.activations == 8 * 32 * FLOAT32 + 8 * 10 * FLOAT32 + 8 * 8 + FLOAT32
    assert next(iter(module.parameters())).grad is None  # the warm-up ran on the copy


def test_gpt2_class_model_counts_tied_embedding_once(tmp_path: Path) -> None:
    module = CausalLM(layers=1, vocab=1000)
    (tokens,) = text(4)[:4]
    result = Predictor(module, None, (tokens,), warm_up=True).baseline()
    assert isinstance(result, ReplayedStep)
    unique = sum(p.numel() * p.element_size() for p in module.parameters())  # parameters() yields a tied one once
    assert result.phases[Phase.FORWARD].breakdown is not None
    assert result.phases[Phase.FORWARD].breakdown.parameters == unique


LOGGED: list[str] = []
"""What :class:`SideEffects` logged, process-wide (a logger's side effect)."""


class SideEffects(Classifier):
    """Logs (to a process-wide list), prints and remembers every step it runs."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 10))
        self.steps_seen: list[int] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        LOGGED.append(name)

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> None:
        LOGGED.extend(dictionary)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_seen.append(batch_idx)
        print("training step", batch_idx)
        torch.manual_seed(1234 + int(random.random() * 1000))  # reseeds torch, draws from Python's generator
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.log_dict({"other": loss})
        return loss


def test_the_step_runs_on_a_copy_logging_printing_and_drawing_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    module = SideEffects()
    batch = _small_batch()
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    result = Predictor(module, [module.configure_optimizers()], batch).baseline()
    assert isinstance(result, ReplayedStep)
    assert module.steps_seen == []  # the copy's list got the step
    assert LOGGED == []
    assert capsys.readouterr() == ("", "")
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
