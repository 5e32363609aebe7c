"""Advice judged by applying it: each run's advice is applied to the model that produced it, the run is repeated
with a real Trainer on the CPU, and the saving the advice estimated must show in the measured counts, the advice
must go away, and backward must still work.

Activation savings are read at the step's activation peak over all its phases: the backward phase's count includes
what a checkpointed unit's recomputation holds, so a plan whose recomputation outweighs the forward pass shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import (
    LanguageModel,
    ResNetStyle,
    TinyGPT,
    activation_mlp,
    apply_plan,
    features,
    images,
    printed_callbacks,
    sequential_cnn,
    tokens,
)
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.measure.setup import training_setup
from lightning_vram.records import Advice, CheckpointPlan, Phase

# Each run's advice is applied and its estimate checked against the saving realised: the estimate is replayed.
pytestmark = pytest.mark.replay

# ------------------------------------------------------------------------------------------------ running and applying


def run(tmp_path: Path, module: pl.LightningModule, data: TensorDataset, batch_size: int) -> Report:
    """Three steps on the CPU, step 2 counted tensor by tensor; the report."""
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(module, loader(data, batch_size))
    assert monitor.report is not None
    return monitor.report


def advice_of(report: Report, advice_id: str) -> Advice | None:
    return next((advice for advice in report.advice if advice.id == advice_id), None)


def peak_activations(report: Report) -> int:
    """The highest activations of the sampled step over its phases (backward's include recomputations)."""
    counts = [peak.breakdown.activations for peak in report.phases.values() if peak.breakdown is not None]
    assert counts
    return max(counts)


def model_state(report: Report) -> int:
    assert report.peak is not None and report.peak.breakdown is not None
    breakdown = report.peak.breakdown
    return breakdown.parameters + breakdown.gradients + breakdown.optimizer_state


# -------------------------------------------------------------------------------------- activation-checkpointing


def planned(report: Report, advice: Advice) -> CheckpointPlan:
    """The candidate plan whose code the advice's detail gives (as a user reads it); its saving when modelled."""
    plans = [
        plan for plan in checkpoint_candidates(report.summary.modules) if checkpoint_snippet(plan)[1] in advice.detail
    ]
    assert len(plans) == 1, advice.detail
    if advice.saving_basis == "modelled":
        assert plans[0].saving_bytes == advice.estimated_saving_bytes
    return plans[0]


CHECKPOINT_CASES = {
    "resnet": (lambda: Classifier(ResNetStyle()), lambda: images(64), 32),
    "transformer-modulelist": (lambda: LanguageModel(TinyGPT()), lambda: tokens(32), 16),
    "sequential-cnn": (lambda: Classifier(sequential_cnn()), lambda: images(64), 32),
}
CHECKPOINT_CODE = {
    # The stem and the last stage free nothing at the peak: the stages before the last, each wrapped where it is (the
    # stem's unit, its inplace relu inside bn1's, is the best modelled plan's: tests/test_checkpointing_same_model.py).
    "resnet": "self.network.layer1 = Checkpointed(self.network.layer1)\nself.network.layer2 = Checkpointed(",
    # A wrapper in place of each block: the loop in TinyGPT's forward calls them as before.
    "transformer-modulelist": "    self.network.h[index] = Checkpointed(self.network.h[index])",
    "sequential-cnn": "    segment = self.network[start:end]\n    x = checkpoint_keeping_buffers(segment, segment, x)",
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_activation_checkpointing_applied(tmp_path: Path, case: str) -> None:
    make_module, make_data, batch_size = CHECKPOINT_CASES[case]
    before = run(tmp_path, make_module(), make_data(), batch_size)
    advice = advice_of(before, "activation-checkpointing")
    assert advice is not None and advice.estimated_saving_bytes is not None
    plan = planned(before, advice)
    inplace = {profile.name for profile in before.summary.modules if profile.inplace is True}
    assert not any(unit[0] in inplace for unit in plan.units)
    assert CHECKPOINT_CODE[case] in advice.detail
    module = make_module()
    apply_plan(module, plan)
    after = run(tmp_path, module, make_data(), batch_size)  # backward raises here if a unit starts inplace
    realised = peak_activations(before) - peak_activations(after)
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert before.peak is not None and after.peak is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert advice_of(after, "activation-checkpointing") is None  # nothing left worth a tenth of the peak


# ------------------------------------------------------------------------------------------------ large-linear


def flatten_head_cnn(pooled: bool = False) -> nn.Sequential:
    """A conv stage on 16 x 16 images, max-pooled to 16 channels x 8 x 8, flattened into Linear(1024, 512).

    ``pooled``: the large-linear advice applied, global average pooling first and Linear(16, 512).
    """
    stage = [nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)]
    pooling = [nn.AdaptiveAvgPool2d(1)] if pooled else []
    head = [nn.Linear(16 if pooled else 16 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10)]
    return nn.Sequential(*stage, *pooling, nn.Flatten(), *head)


def test_large_linear_fires_on_a_flattened_feature_map_with_the_exact_saving(tmp_path: Path) -> None:
    # SGD with momentum: gradients and momentum are one copy each of the parameters, so model state is 3 bytes per
    # parameter byte (at the live peak, in backward, a few gradients are not made yet: within 0.1%). Pooling turns
    # Linear(16 * 64, 512) into Linear(16, 512): it removes 512 * (1024 - 16) float32 weights.
    report = run(tmp_path, Classifier(flatten_head_cnn(), OPTIMIZERS["sgd_momentum"]), images(64), 8)
    advice = advice_of(report, "large-linear")
    assert advice is not None
    assert advice.estimated_saving_bytes == pytest.approx(3 * 512 * (1024 - 16) * 4, rel=0.001)
    assert "`network.5` reads a flattened feature map of 64 positions" in advice.title
    assert "Linear(1024, 512) becomes Linear(16, 512)" in advice.detail
    assert "convolutional map of 16 channels x 64 positions" in advice.evidence


def test_large_linear_applied_saves_what_it_estimated(tmp_path: Path) -> None:
    before = run(tmp_path, Classifier(flatten_head_cnn(), OPTIMIZERS["adam"]), images(64), 8)
    advice = advice_of(before, "large-linear")
    assert advice is not None and advice.estimated_saving_bytes is not None
    after = run(tmp_path, Classifier(flatten_head_cnn(pooled=True), OPTIMIZERS["adam"]), images(64), 8)
    realised = model_state(before) - model_state(after)
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert advice_of(after, "large-linear") is None


def sequence_cnn_body() -> list[nn.Module]:
    """Two 1-D convolutions over 8 channels x 256 steps (a signal, a sequence's embeddings): a (B, 64, 256) map."""
    return [nn.Conv1d(8, 64, 5, padding=2), nn.BatchNorm1d(64), nn.ReLU(inplace=True), nn.Conv1d(64, 64, 5, padding=2)]


def test_large_linear_prints_the_pooling_of_the_maps_dimensions_and_applied_realises_it(tmp_path: Path) -> None:
    # A Conv1d map flattened into Linear(64 * 256, 128). Before, the printed line pooled with AdaptiveAvgPool2d,
    # which reads a (B, 64, 256) map as one unbatched (C, H, W) image: (B, 1, 1), then Linear(64, 128) raised.
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, 256, generator=generator), torch.randint(0, 10, (96,), generator=generator))
    head = [nn.Flatten(), nn.Linear(64 * 256, 128), nn.ReLU(), nn.Linear(128, 10)]
    before = run(tmp_path, Classifier(nn.Sequential(*sequence_cnn_body(), *head), OPTIMIZERS["adam"]), data, 16)
    advice = advice_of(before, "large-linear")
    assert advice is not None and advice.estimated_saving_bytes is not None and before.peak is not None
    (code,) = [block.split("```")[0].strip() for block in advice.detail.split("```python\n")[1:]]
    assert code == "nn.Sequential(..., nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, 128))"
    pooled = eval(code.replace("...", "*body"), {"nn": nn, "body": sequence_cnn_body()})  # as printed
    network = nn.Sequential(*pooled, nn.ReLU(), nn.Linear(128, 10))  # the layers after the Linear, kept
    after = run(tmp_path, Classifier(network, OPTIMIZERS["adam"]), data, 16)
    assert after.peak is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes >= advice.estimated_saving_bytes  # realised, at least
    assert advice_of(after, "large-linear") is None


def mlp_head() -> nn.Sequential:
    """Most parameters in the first Linear, which reads raw features: no map to pool."""
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def test_large_linear_is_silent_without_a_feature_map(tmp_path: Path) -> None:
    # The MLP's first layer holds 99% of its parameters; the language model's lm_head is tied to its embedding
    # (no bytes of its own) and reads hidden states, not a convolutional map. Pooling is no remedy for either.
    mlp = run(tmp_path, Classifier(mlp_head()), features(32, 1024), 4)
    assert advice_of(mlp, "large-linear") is None
    language = run(tmp_path, LanguageModel(TinyGPT(vocab=4096)), tokens(16, vocab=4096), 4)
    assert advice_of(language, "large-linear") is None
    layers = training_setup(LanguageModel(TinyGPT(vocab=4096)), []).linear_layers
    head = next(layer for layer in layers if layer.name == "network.lm_head")
    assert (head.weight_bytes, head.parameter_bytes) == (0, 0)


# ------------------------------------------------------------------------------------------------ inplace-activations


def test_inplace_relu_frees_nothing_the_counts_see_so_it_is_not_advised(tmp_path: Path) -> None:
    # ReLU saves its output, which the next Linear saves too: out of place or inplace, one saved tensor per
    # layer. Out of place, its input is a transient the live peak sees (one 512 x 256 float32 tensor beyond the
    # counted parts); the rule does not promise it, and nothing it counts changes.
    out_of_place = run(tmp_path, Classifier(activation_mlp(nn.ReLU)), features(1024, 256), 512)
    assert advice_of(out_of_place, "inplace-activations") is None
    inplace = run(tmp_path, Classifier(activation_mlp(nn.ReLU, inplace=True)), features(1024, 256), 512)
    assert out_of_place.peak is not None and inplace.peak is not None
    assert out_of_place.peak.breakdown is not None and inplace.peak.breakdown is not None
    assert inplace.peak.breakdown.counted_bytes == out_of_place.peak.breakdown.counted_bytes
    assert out_of_place.peak.peak_bytes - inplace.peak.peak_bytes == pytest.approx(512 * 256 * 4, rel=0.1)


def test_inplace_activations_applied_saves_what_it_estimated(tmp_path: Path) -> None:
    # LeakyReLU out of place saves its input and the next Linear its output: two 512 x 256 float32 tensors per
    # layer. leaky_relu_ computes its gradient from its result: one tensor. Four layers: 4 x 512 KiB.
    module = Classifier(activation_mlp(nn.LeakyReLU))
    before = run(tmp_path, module, features(1024, 256), 512)
    assert not any(child.inplace for child in module.modules() if isinstance(child, nn.LeakyReLU))  # tried on copies
    advice = advice_of(before, "inplace-activations")
    assert advice is not None
    assert advice.estimated_saving_bytes == 4 * 512 * 256 * 4
    assert "4 activation module(s) run out of place (LeakyReLU)" in advice.evidence
    after = run(tmp_path, Classifier(activation_mlp(nn.LeakyReLU, inplace=True)), features(1024, 256), 512)
    assert peak_activations(before) - peak_activations(after) == advice.estimated_saving_bytes
    assert before.peak is not None and after.peak is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == advice.estimated_saving_bytes
    assert advice_of(after, "inplace-activations") is None


def test_inplace_is_not_advised_where_it_keeps_a_copy(tmp_path: Path) -> None:
    # silu_ keeps a copy of the input it overwrites for its gradient: inplace saves nothing there.
    report = run(tmp_path, Classifier(activation_mlp(nn.SiLU)), features(1024, 256), 512)
    assert advice_of(report, "inplace-activations") is None


# ------------------------------------------------------------------------------------------------ stale-gradients


def mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class FreeGradientsBeforeForward(pl.Callback):
    """The stale-gradients advice's printed callback, applied where it is not advised (listed before the monitor)."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        if index % trainer.accumulate_grad_batches == 0:
            for optimizer in trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)


def mlp_run(
    tmp_path: Path,
    width: int,
    depth: int,
    batch_size: int,
    callbacks: Callable[[VramMonitor], list[pl.Callback]] = lambda monitor: [monitor],
) -> Report:
    """An MLP trained with plain SGD: its optimizer step holds no state or temporaries, so the live peak is in
    forward when the last step's gradients are alive there (Adam's step holds its temporaries, peaking higher).

    ``callbacks``: the Trainer's callbacks around the monitor (default: the monitor alone).
    """
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4 * batch_size, width, generator=generator), torch.randint(0, 10, (4 * batch_size,))
    )
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=5, console_summary=False)
    trainer(tmp_path, callbacks(monitor), max_steps=4).fit(
        Classifier(mlp(width, depth), OPTIMIZERS["sgd"]), loader(data, batch_size)
    )
    assert monitor.report is not None
    return monitor.report


@pytest.mark.parametrize(
    ("width", "depth", "batch_size"),
    [(512, 2, 64), (256, 1, 64)],
    ids=["wide", "narrow"],
)
def test_applying_the_stale_gradients_advice_removes_it_and_saves_what_it_said(
    tmp_path: Path, width: int, depth: int, batch_size: int
) -> None:
    before = mlp_run(tmp_path / "before", width, depth, batch_size)
    [advice] = [item for item in before.advice if item.id == "stale-gradients"]
    assert "def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):" in advice.detail
    assert "optimizer.zero_grad(set_to_none=True)" in advice.detail
    assert "callbacks=[FreeGradientsBeforeForward(), VramMonitor()]" in advice.detail
    assert advice.estimated_saving_bytes is not None and advice.estimated_saving_bytes > 0
    stale = before.phases[Phase.FORWARD].breakdown
    assert stale is not None and stale.gradients > 0

    after = mlp_run(tmp_path / "after", width, depth, batch_size, lambda monitor: printed_callbacks(advice, monitor))
    assert "stale-gradients" not in {item.id for item in after.advice}
    forward = after.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.gradients == 0
    # The forward pass no longer holds the last step's gradients: its counted parts lose exactly them, and they are
    # freed before the monitor starts the step, so its live peak holds nothing more ("other") than before ...
    assert forward.counted_bytes == stale.counted_bytes - stale.gradients
    assert forward.other is not None and stale.other is not None and forward.other <= stale.other
    # ... the report's own replay of the step reproduces it and is trusted ...
    assert after.simulation is not None and after.simulation.skipped is None
    # ... and the run's live peak falls by what the advice promised (the forward peak's excess over the next phase).
    assert before.peak is not None and after.peak is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)


def test_stale_gradients_is_silent_where_backward_peaks_as_high(tmp_path: Path) -> None:
    # Activations dominate: the live peak of backward (activations and the first gradients) is as high as the
    # forward peak with the last step's gradients; freeing them lowers forward only, not the run's peak.
    before = mlp_run(tmp_path / "before", 256, 2, 512)
    forward, backward = before.phases[Phase.FORWARD], before.phases[Phase.BACKWARD]
    assert forward.breakdown is not None and forward.breakdown.gradients > 0
    assert forward.peak_bytes - backward.peak_bytes < 0.01 * forward.peak_bytes
    assert "stale-gradients" not in {item.id for item in before.advice}
    after = mlp_run(tmp_path / "after", 256, 2, 512, lambda monitor: [FreeGradientsBeforeForward(), monitor])
    assert before.peak is not None and after.peak is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes < 0.01 * before.peak.peak_bytes
