"""Each rule's printed change, applied, trains the same model: bit for bit where the arithmetic is the same, else
within the tolerance the advice itself states.

For each rule with printed code, a model of the kind it targets is trained three times from one seed with a real
Trainer on the CPU: with the monitor (whose report gives the advice and its printed code), with the printed change
applied and no monitor, and with neither. Losses (every batch's, as Lightning hands them to callbacks), the
state_dict (weights and buffers: BatchNorm's running statistics and ``num_batches_tracked``), the optimizer's state
and the torch, numpy and Python RNG states are compared. Checkpointing has its own file
(tests/test_checkpointing_same_model.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from advice_models import (
    ChunkedLanguageModel,
    LanguageModel,
    TinyGPT,
    activation_mlp,
    features,
    images,
    printed_callbacks,
    tokens,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from models import OPTIMIZERS, Classifier, cnn_net, dataset, dataset_for, mlp, trainer
from preloaded_python import run_script
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.advice.rules.allocator_fragmentation import allocator_fragmentation
from lightning_vram.advice.rules.batch_size_headroom import batch_size_headroom
from lightning_vram.advice.rules.dataloader_workers import dataloader_workers
from lightning_vram.advice.rules.mixed_precision import mixed_precision
from lightning_vram.advice.rules.near_capacity import near_capacity
from lightning_vram.advice.rules.pin_memory import pin_memory
from lightning_vram.measure.setup import training_setup
from lightning_vram.records import Advice, DeviceInfo

# ---------------------------------------------------------------------------------------------- training, compared


@dataclass(frozen=True)
class Trained:
    """What a run leaves: its losses, the module's state, the optimizer's state, every RNG's state."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    optimizer: list[tuple[str, Any]]
    rng: tuple[torch.Tensor, Any, Any]
    report: Report | None


class Losses(pl.Callback):
    """Every batch's loss as Lightning hands it to callbacks (divided by ``accumulate_grad_batches``)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.values.append(float(outputs["loss"]))


def flattened(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``value`` (an optimizer's state_dict) as (path, leaf) pairs, tensors cloned."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from flattened(value[key], f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from flattened(item, f"{path}[{index}]")
    else:
        yield path, value.detach().clone() if isinstance(value, torch.Tensor) else value


def shuffled(data: TensorDataset, batch_size: int, **options: Any) -> DataLoader[Any]:
    """A shuffling DataLoader: its sampler draws from the torch RNG every epoch, as most training loops do."""
    return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True, **options)


def fit(
    root: Path,
    build: Callable[[], pl.LightningModule],
    batches: Callable[[], DataLoader[Any]],
    steps: int,
    monitored: bool = False,
    applied: Advice | None = None,
    **options: Any,
) -> Trained:
    """``steps`` optimizer steps from seed 0 (torch, numpy, Python), with the monitor or without; what they leave.

    ``applied``: a stale-gradients advice whose printed callbacks the Trainer lists first, the monitor (where the run
    is monitored) in its printed place.
    """
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    module = build()
    losses = Losses()
    callbacks: list[pl.Callback] = [losses]
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    if applied is not None:
        callbacks[:0] = printed_callbacks(applied, monitor if monitored else None)
    elif monitored:
        callbacks.insert(0, monitor)
    run = trainer(root, callbacks, max_steps=steps, **options)
    run.fit(module, batches())
    state = {key: value.detach().clone() for key, value in module.state_dict().items()}
    optimizer = [leaf for optimizer in run.optimizers for leaf in flattened(optimizer.state_dict())]
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    return Trained(losses.values, state, optimizer, rng, monitor.report if monitored else None)


def assert_identical(first: Trained, second: Trained) -> None:
    """Bit for bit: losses, weights and buffers, optimizer state, RNG states."""
    assert first.losses == second.losses
    assert first.state.keys() == second.state.keys()
    assert [key for key in first.state if not torch.equal(first.state[key], second.state[key])] == []
    assert_same_optimizer(first.optimizer, second.optimizer)
    assert_same_rng(first, second)


def assert_same_optimizer(first: list[tuple[str, Any]], second: list[tuple[str, Any]]) -> None:
    """Two optimizer state_dicts, flattened, bit for bit."""
    assert [path for path, _ in first] == [path for path, _ in second]
    different = [
        path
        for (path, a), (_, b) in zip(first, second, strict=True)
        if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
    ]
    assert different == []


def assert_same_rng(first: Trained, second: Trained) -> None:
    assert torch.equal(first.rng[0], second.rng[0])
    assert first.rng[1][0] == second.rng[1][0] and np.array_equal(first.rng[1][1], second.rng[1][1])
    assert first.rng[1][2:] == second.rng[1][2:]
    assert first.rng[2] == second.rng[2]


def largest_relative_difference(first: Trained, second: Trained) -> float:
    """The largest difference between two runs' floating-point weights, relative to the largest weight of each."""
    worst = 0.0
    for key, a in first.state.items():
        b = second.state[key]
        if a.is_floating_point():
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item())
    return worst


def advice_of(report: Report | None, advice_id: str) -> Advice:
    assert report is not None
    found = [advice for advice in report.advice if advice.id == advice_id]
    assert len(found) == 1, [advice.id for advice in report.advice]
    return found[0]


def printed_code(advice: Advice) -> str:
    """The advice's one code block, as printed."""
    (code,) = re.findall(r"```(?:python|bash)\n(.*?)\n```", advice.detail, re.DOTALL)
    return code  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ inplace-activations


class Block(nn.Module):
    """A ResNet basic block with ``activation`` for its ReLUs: conv-BN-act-conv-BN, the input added back, act."""

    def __init__(self, channels: int, activation: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.act1 = activation()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.act2 = activation()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(inputs)))
        return self.act2(self.bn2(self.conv2(out)) + inputs)  # type: ignore[no-any-return]


def activated_resnet(activation: Callable[[], nn.Module], width: int = 8) -> nn.Sequential:
    """A stem (conv-BN-act), two basic blocks, pooling, Dropout and a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        activation(),
        Block(width, activation),
        Block(width, activation),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(width, 10),
    )


def made_inplace(module: pl.LightningModule, code: str) -> pl.LightningModule:
    """The printed inplace-activations change on ``module``: its lines, run in the LightningModule's ``__init__`` once
    the model is built, set ``inplace`` on each module they name (its other arguments kept)."""
    exec(code, {"self": module})
    return module


INPLACE_CASES: dict[str, tuple[Callable[[], nn.Module], str]] = {
    # LeakyReLU's gradient from its result is the same arithmetic: bit for bit
    "leaky_relu": (lambda: nn.LeakyReLU(0.2), "nn.LeakyReLU(inplace=True)"),
    # ELU's from its result recovers exp(x) as result + alpha: float32 rounding, said in the advice
    "elu": (lambda: nn.ELU(0.5), "nn.ELU(inplace=True)"),
}


@pytest.mark.replay
@pytest.mark.parametrize("case", sorted(INPLACE_CASES))
def test_inplace_activations_as_printed_train_the_same_model(tmp_path: Path, case: str) -> None:
    activation, constructor = INPLACE_CASES[case]
    data = images(96)

    def build(inplace_code: str | None = None) -> Callable[[], pl.LightningModule]:
        def make() -> pl.LightningModule:
            module = Classifier(activated_resnet(activation), OPTIMIZERS["adam"])
            return made_inplace(module, inplace_code) if inplace_code else module

        return make

    monitored = fit(tmp_path, build(), lambda: shuffled(data, 16), steps=8, monitored=True)
    advice = advice_of(monitored.report, "inplace-activations")
    code = printed_code(advice)
    assert f"`{constructor}`" in code and ".inplace = True" in code
    applied = fit(tmp_path, build(code), lambda: shuffled(data, 16), steps=8)
    plain = fit(tmp_path, build(), lambda: shuffled(data, 16), steps=8)
    assert_identical(monitored, plain)
    assert plain.state["network.3.bn1.num_batches_tracked"].item() == 8
    if case == "leaky_relu":
        assert "bit for bit" in advice.detail
        assert_identical(applied, plain)
        return
    assert "float32 rounding" in advice.detail
    assert applied.losses[0] == plain.losses[0]  # forward is the same arithmetic; gradients are not
    assert applied.losses == pytest.approx(plain.losses, rel=1e-5)  # seen: equal over 8 steps
    assert largest_relative_difference(applied, plain) < 1e-5  # seen: 2.2e-6
    assert applied.state["network.3.bn1.num_batches_tracked"].item() == 8
    assert_same_rng(applied, plain)


class ResidualActivation(nn.Module):
    """``fc2(act(h)) + h``: the activation's input is read again after it (a residual connection). Inplace, the act
    would overwrite ``h`` with its result and the block would add ``act(h)`` instead; autograd raises nothing (the
    addition saves no tensor)."""

    def __init__(self, width: int, inplace: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.LeakyReLU(inplace=inplace)
        self.fc2 = nn.Linear(width, width)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(inputs)
        return self.fc2(self.act(hidden)) + hidden  # type: ignore[no-any-return]


def residual_mlp(inplace: bool = False) -> nn.Sequential:
    return nn.Sequential(*(ResidualActivation(256, inplace) for _ in range(4)), nn.Linear(256, 10))


@pytest.mark.replay
def test_inplace_activations_are_not_advised_where_a_residual_reads_their_input(tmp_path: Path) -> None:
    # Each LeakyReLU saves its input while fc2 saves its output, and no earlier op saved the input: everything the
    # rule counts says inplace merges two saved tensors (5.1% of the peak). But the block adds the input back after
    # the activation: inplace, it adds the activation's result, and the model learns something else. Before the replay
    # watched later reads, the rule advised `nn.LeakyReLU(inplace=True)` here ("Training is unchanged: the same
    # gradients, bit for bit").
    data = features(256, 256)
    monitored = fit(tmp_path, lambda: Classifier(residual_mlp()), lambda: shuffled(data, 64), steps=4, monitored=True)
    assert monitored.report is not None
    assert "inplace-activations" not in [advice.id for advice in monitored.report.advice]
    (reason,) = [item.reason for item in monitored.report.not_advised if item.id == "inplace-activations"]
    assert "`network.0.act`" in reason and "read again after the activation" in reason
    assert reason.endswith("inplace would change what the model computes")
    # Why: the change, applied, trains another model.
    plain = fit(tmp_path, lambda: Classifier(residual_mlp()), lambda: shuffled(data, 64), steps=4)
    applied = fit(tmp_path, lambda: Classifier(residual_mlp(inplace=True)), lambda: shuffled(data, 64), steps=4)
    assert_identical(monitored, plain)
    assert applied.losses[0] != plain.losses[0]


class GatedActivation(nn.Module):
    """``fc2(act(h[:, :w]) * h[:, w:])``: the gate reads the other half of the activation input's storage, after it."""

    def __init__(self, width: int, inplace: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.act = nn.LeakyReLU(inplace=inplace)
        self.fc2 = nn.Linear(width, width)
        self.width = width

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(inputs)
        return self.fc2(self.act(hidden[:, : self.width]) * hidden[:, self.width :])  # type: ignore[no-any-return]


@pytest.mark.replay
def test_inplace_activations_are_advised_where_only_another_part_of_their_input_is_read_later(tmp_path: Path) -> None:
    # The half the gate reads shares the activation's input's storage but none of its elements: inplace changes
    # nothing there, and the advice stands (the later-read check tells the halves apart).
    data = features(256, 256)

    def build(inplace: bool = False) -> Callable[[], pl.LightningModule]:
        return lambda: Classifier(nn.Sequential(*(GatedActivation(256, inplace) for _ in range(4)), nn.Linear(256, 10)))

    monitored = fit(tmp_path, build(), lambda: shuffled(data, 64), steps=4, monitored=True)
    advice = advice_of(monitored.report, "inplace-activations")
    assert "saw no op read these inputs again" in advice.detail and "bit for bit" in advice.detail
    plain = fit(tmp_path, build(), lambda: shuffled(data, 64), steps=4)
    assert_identical(fit(tmp_path, build(inplace=True), lambda: shuffled(data, 64), steps=4), plain)
    assert_identical(monitored, plain)


# ------------------------------------------------------------------------------------------------ stale-gradients


class OwnAccumulation(Classifier):
    """Accumulates two batches by Lightning's documented hooks: zeroes gradients on even batches, steps on odd ones."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if batch_idx % 2 == 0:
            optimizer.zero_grad()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 1:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


@pytest.mark.replay
def test_freeing_gradients_is_not_advised_where_the_module_zeroes_them_itself(tmp_path: Path) -> None:
    # Sampled at batch 2, the forward pass peaks with the gradients of the window that stepped at batch 1 alive: as
    # stale as the rule looks for. But the module zeroes gradients itself, every other batch: the printed callback
    # (freeing them at every batch start, as accumulate_grad_batches is 1) would discard the gradients it accumulates
    # over batches 2 and 3. Before, the rule advised it ("training is unchanged, bit for bit"), and applied as printed
    # the third loss and every weight differed.
    data = features(4096, 256)

    def run(monitor: VramMonitor | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        module = OwnAccumulation(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"])
        losses = Losses()
        trainer(tmp_path, [losses] if monitor is None else [monitor, losses], max_steps=6).fit(
            module, DataLoader(data, batch_size=512)
        )
        return losses.values, {key: value.clone() for key, value in module.state_dict().items()}

    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    monitored = run(monitor)
    report = monitor.report
    assert report is not None and report.peak is not None and report.peak.phase.value == "forward"
    assert "stale-gradients" not in [advice.id for advice in report.advice]
    (reason,) = [item.reason for item in report.not_advised if item.id == "stale-gradients"]
    assert "overrides optimizer_zero_grad" in reason
    plain = run(None)
    assert monitored[0] == plain[0]
    assert [key for key in plain[1] if not torch.equal(plain[1][key], monitored[1][key])] == []


@pytest.mark.replay
def test_freeing_gradients_as_printed_trains_the_same_model_with_and_without_accumulation(tmp_path: Path) -> None:
    # An MLP whose forward pass peaks with the last step's gradients alive (Adam), as the rule targets.
    data = features(1024, 256)

    def build() -> pl.LightningModule:
        return Classifier(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 512), steps=4, monitored=True)
    advice = advice_of(monitored.report, "stale-gradients")
    assert "training is unchanged, bit for bit" in advice.detail
    plain = fit(tmp_path, build, lambda: shuffled(data, 512), steps=4)
    assert_identical(monitored, plain)
    # The printed callbacks, with the monitor where they list it and without it.
    applied = fit(tmp_path, build, lambda: shuffled(data, 512), steps=4, monitored=True, applied=advice)
    assert applied.report is not None and "stale-gradients" not in [item.id for item in applied.report.advice]
    assert_identical(applied, plain)
    assert_identical(fit(tmp_path, build, lambda: shuffled(data, 512), steps=4, applied=advice), plain)
    # Accumulating 3 batches over epochs of 5: windows of 3 and 2 batches, across the epoch boundary. The callback frees
    # gradients only where Lightning would zero them (the first batch of a window), never inside one.
    small = features(640, 256)
    accumulating = {"accumulate_grad_batches": 3}
    applied = fit(tmp_path, build, lambda: shuffled(small, 128), steps=5, applied=advice, **accumulating)
    plain = fit(tmp_path, build, lambda: shuffled(small, 128), steps=5, **accumulating)
    assert len(plain.losses) == 13  # two epochs of 5 batches (windows of 3 and 2: 4 steps), then 3 more (1 step)
    assert_identical(applied, plain)


# ------------------------------------------------------------------------------------------------ chunked-loss


@pytest.mark.replay
def test_chunked_loss_as_printed_trains_the_same_model_to_the_tolerance_it_states(tmp_path: Path) -> None:
    # A 4096-token vocabulary: the log-probabilities are most of the activations, as the rule targets.
    data = tokens(64, vocab=4096)

    def network() -> TinyGPT:
        return TinyGPT(vocab=4096, layers=2)

    monitored = fit(
        tmp_path,
        lambda: LanguageModel(network(), OPTIMIZERS["adamw"]),
        lambda: shuffled(data, 8),
        steps=8,
        monitored=True,
    )
    advice = advice_of(monitored.report, "chunked-loss")
    namespace: dict[str, Any] = {}
    exec(printed_code(advice), namespace)
    chunked = namespace["chunked_cross_entropy"]
    applied = fit(
        tmp_path,
        lambda: ChunkedLanguageModel(network(), chunked, OPTIMIZERS["adamw"]),
        lambda: shuffled(data, 8),
        steps=8,
    )
    plain = fit(tmp_path, lambda: LanguageModel(network(), OPTIMIZERS["adamw"]), lambda: shuffled(data, 8), steps=8)
    assert_identical(monitored, plain)
    assert "float32 rounding (about 1e-6 relative), not bit for bit" in advice.detail
    assert applied.losses == pytest.approx(plain.losses, rel=1e-6)  # seen: up to 1.7e-7
    learning_rate = 1e-3  # AdamW's: no step moves a weight further
    for key, weight in plain.state.items():
        difference = (applied.state[key] - weight).abs().max().item()
        if key.endswith("attn.in_proj_bias"):
            # The key projection's bias has no true gradient (softmax ignores a shift): AdamW normalises rounding
            # noise into steps of up to its learning rate there (seen: 3.6e-4), as the advice says.
            assert difference <= learning_rate * 8, key
        else:
            assert difference <= 1e-6 * max(1.0, weight.abs().max().item()), key  # seen: up to 6e-7
    assert_same_rng(applied, plain)


# ------------------------------------------------------------------------------------- near-capacity: halved batch


def near_capacity_advice(report: Report | None, module: pl.LightningModule) -> Advice:
    """The run's near-capacity advice as if it had run on a CUDA device its peak fills (95%)."""
    assert report is not None and report.peak is not None
    device = DeviceInfo("cuda", "a device this run fills", 0, int(report.peak.peak_bytes / 0.95), (8, 0))
    setup = training_setup(module, [module.configure_optimizers()])
    advice = near_capacity(replace(report.summary, device=device), setup, report.simulation)
    assert advice is not None
    return advice


HALVED = re.compile(r"halve the batch to (\d+) \(with accumulate_grad_batches=(\d+)\)")

ACCUMULATION_CASES: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: mlp(64, 2, activation=nn.ReLU),
    "batchnorm": cnn_net,
}


@pytest.mark.replay
@pytest.mark.parametrize("case", sorted(ACCUMULATION_CASES))
def test_halved_batch_with_accumulation_as_printed(tmp_path: Path, case: str) -> None:
    network = ACCUMULATION_CASES[case]
    data = dataset_for("cnn", 256) if case == "batchnorm" else dataset(64, 256)

    def build() -> pl.LightningModule:
        return Classifier(network(), OPTIMIZERS["sgd_momentum"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 32), steps=6, monitored=True)
    advice = near_capacity_advice(monitored.report, build())
    found = HALVED.search(advice.detail)
    assert found is not None, advice.detail
    batch_size, accumulate = int(found[1]), int(found[2])
    assert (batch_size, accumulate) == (16, 2)
    applied = fit(tmp_path, build, lambda: shuffled(data, batch_size), steps=6, accumulate_grad_batches=accumulate)
    plain = fit(tmp_path, build, lambda: shuffled(data, 32), steps=6)
    assert_identical(monitored, plain)
    # Lightning divides each half's loss by 2: two halves' losses add up to the whole batch's.
    halves = [sum(applied.losses[index : index + 2]) for index in range(0, len(applied.losses), 2)]
    if case == "mlp":
        assert (
            "the same as the whole batch's up to float32 rounding (about 1e-6 relative) where the loss is a mean"
            in (advice.detail)
        )
        assert halves == pytest.approx(plain.losses, rel=1e-6)  # seen: up to 1.0e-7
        for key, weight in plain.state.items():
            assert (applied.state[key] - weight).abs().max().item() <= 1e-6 * weight.abs().max().item()  # seen: 7e-9
    else:
        # Each half normalised on its own: a different model, as the advice says.
        assert "BatchNorm then normalises over 16 samples instead of 32" in advice.detail
        assert "trains a different model" in advice.detail
        assert plain.state["network.1.num_batches_tracked"].item() == 6
        assert applied.state["network.1.num_batches_tracked"].item() == 12
        assert not torch.allclose(applied.state["network.1.running_var"], plain.state["network.1.running_var"])
    assert_same_rng(applied, plain)


# ------------------------------------------------------------------------------------------ allocator-fragmentation

TRAIN_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader, trainer
torch.manual_seed(0)
module = Classifier(cnn_net(), OPTIMIZERS["adam"])
run = trainer(sys.argv[1], [], max_steps=4)
run.fit(module, loader(dataset_for("cnn", 64), 16))
torch.save((module.state_dict(), run.optimizers[0].state_dict(), torch.get_rng_state()), sys.argv[2])
"""


def test_allocator_settings_as_printed_train_the_same_model(tmp_path: Path) -> None:
    # The settings change where the allocator maps memory, never what is computed: a run launched with the printed
    # command line trains as one launched without it. The Trainer here runs on the CPU, where nothing reads the
    # variable: this pins the printed command and the claim, not the CUDA allocator's behaviour.
    report = fit(tmp_path, lambda: Classifier(cnn_net()), lambda: shuffled(dataset_for("cnn", 64), 16), 3, True).report
    assert report is not None and report.peak is not None
    fragmented = replace(report.peak, reserved_bytes=report.peak.peak_bytes + 512 * 2**20)
    summary = replace(report.summary, device=DeviceInfo("cuda", "GPU", 0, 80 * 2**30, (8, 0)), peak=fragmented)
    advice = allocator_fragmentation(summary, training_setup(Classifier(cnn_net()), []), None)
    assert advice is not None and "training is unchanged, bit for bit" in advice.detail
    variable, _, command = printed_code(advice).partition(" ")
    name, _, value = variable.partition("=")
    assert (name, value, command) == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "python train.py")
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    environment = {key: item for key, item in os.environ.items() if key != name}
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])
    saved = []
    for launch in ({}, {name: value}):
        saved.append(tmp_path / f"trained{len(saved)}.pt")
        ran = run_script(script, str(tmp_path / "root"), str(saved[-1]), env={**environment, **launch}, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
    (state, optimizer, rng), (state_set, optimizer_set, rng_set) = (torch.load(path) for path in saved)
    assert [key for key in state if not torch.equal(state[key], state_set[key])] == []
    assert state["network.1.num_batches_tracked"].item() == 4
    assert_same_optimizer(list(flattened(optimizer)), list(flattened(optimizer_set)))
    assert torch.equal(rng, rng_set)


# ------------------------------------------------------------------------------------------------ mixed-precision


def printed_trainer_arguments(advice: Advice) -> dict[str, Any]:
    """The keyword arguments of the advice's printed ``Trainer(...)`` line."""
    arguments: dict[str, Any] = eval(printed_code(advice), {"Trainer": dict})
    return arguments


def mixed_precision_advice(report: Report | None, capability: tuple[int, int]) -> Advice:
    """The run's mixed-precision advice as if it had trained on a CUDA device of ``capability``."""
    assert report is not None
    device = DeviceInfo("cuda", f"a GPU of compute capability {capability}", 0, 80 * 2**30, capability)
    advice = mixed_precision(replace(report.summary, device=device), training_setup(Classifier(cnn_net()), []))
    assert advice is not None
    return advice


def test_mixed_precision_says_it_changes_numerics_and_keeps_loss_scaling_for_float16(tmp_path: Path) -> None:
    data = dataset_for("cnn", 128)

    def build() -> pl.LightningModule:
        return Classifier(cnn_net(), OPTIMIZERS["adam"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 16), steps=6, monitored=True)
    plain = fit(tmp_path, build, lambda: shuffled(data, 16), steps=6)
    assert_identical(monitored, plain)

    # float16 (a T4): the advice says the loss must be scaled, and its printed Trainer argument gives a GradScaler.
    float16 = mixed_precision_advice(monitored.report, (7, 5))
    assert "This changes the numerics" in float16.detail and "keep that scaler" in float16.detail
    arguments = printed_trainer_arguments(float16)
    assert arguments == {"precision": "16-mixed"}
    # What Lightning's Trainer builds for it on a CUDA device (its accelerator connector: MixedPrecision(precision,
    # "cuda")); without CUDA the scaler is built but disables itself, warning so.
    without_cuda = pytest.warns(UserWarning, match="CUDA is not available")
    with contextlib.nullcontext() if torch.cuda.is_available() else without_cuda:
        plugin = MixedPrecision(arguments["precision"], "cuda")
    assert isinstance(plugin.scaler, torch.amp.GradScaler)

    # bfloat16 (an A100): applied, weights and optimizer state stay float32 as the advice says, and the numerics
    # change as it says too.
    bfloat16 = mixed_precision_advice(monitored.report, (8, 0))
    assert "This changes the numerics" in bfloat16.detail and "needs no loss scaling" in bfloat16.detail
    assert "Weights and optimizer state stay in float32" in bfloat16.detail
    arguments = printed_trainer_arguments(bfloat16)
    assert arguments == {"precision": "bf16-mixed"}
    applied = fit(tmp_path, build, lambda: shuffled(data, 16), steps=6, **arguments)
    assert {value.dtype for key, value in applied.state.items() if "num_batches" not in key} == {torch.float32}
    assert {value.dtype for _, value in applied.optimizer if isinstance(value, torch.Tensor)} == {torch.float32}
    assert applied.losses != plain.losses
    assert applied.losses == pytest.approx(plain.losses, rel=1e-3)  # seen: up to 1.1e-4 relative
    assert_same_rng(applied, plain)


# ------------------------------------------------------------------------------------------------ dataloader-workers


def dropout_mlp() -> nn.Sequential:
    """Flattened 3 x 8 x 8 images through an MLP with Dropout: every step draws from the torch RNG."""
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))


def printed_loader_arguments(advice: Advice) -> dict[str, Any]:
    """The keyword arguments of the advice's printed ``DataLoader(dataset, ..., name=value)`` line: ``...`` stands
    for the user's own arguments, kept as they are (shuffle, sampler, collate_fn: which samples each step sees)."""

    def loader(dataset: Any, *own: Any, **arguments: Any) -> dict[str, Any]:
        assert own == (Ellipsis,), own  # before: `batch_size=...` alone, the user's other arguments left out
        return arguments

    arguments: dict[str, Any] = eval(printed_code(advice), {"DataLoader": loader, "dataset": None})
    return arguments


def test_dataloader_workers_as_printed_say_what_they_change_in_the_random_stream(tmp_path: Path) -> None:
    data = dataset_for("cnn", 64)  # 4 batches of 16 an epoch: 12 steps are three epochs

    def build() -> pl.LightningModule:
        return Classifier(dropout_mlp(), OPTIMIZERS["adam"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 16), steps=12, monitored=True)
    assert monitored.report is not None
    waiting = replace(
        monitored.report.summary,
        data_wait_fraction=0.5,
        recent_data_wait_fraction=0.5,
        step_seconds_median=1.0,
        timed_steps=100,
    )
    setup = replace(training_setup(build(), [], dataloaders=shuffled(data, 16)), cpu_cores_per_device=3)
    advice = dataloader_workers(waiting, setup)
    assert advice is not None
    arguments = printed_loader_arguments(advice)
    assert arguments == {"num_workers": 2, "persistent_workers": True}
    assert "The same computation, but not the same random numbers" in advice.detail
    assert "persistent workers draw that seed once" in advice.detail
    applied = fit(tmp_path, build, lambda: shuffled(data, 16, **arguments), steps=12)
    plain = fit(tmp_path, build, lambda: shuffled(data, 16), steps=12)
    assert_identical(monitored, plain)
    # The first epoch draws as without workers; from the second, persistent workers draw no new seed from the torch
    # RNG, so shuffling and Dropout see another stream: another random draw of the same training, as the advice says.
    assert applied.losses[:4] == plain.losses[:4]
    assert applied.losses[4:] != plain.losses[4:]
    assert not torch.equal(applied.rng[0], plain.rng[0])
    # Workers that are not persistent draw as the main process does: the same model, bit for bit.
    arguments["persistent_workers"] = False
    assert_identical(fit(tmp_path, build, lambda: shuffled(data, 16, **arguments), steps=12), plain)


class Drawing(torch.utils.data.Sampler[int]):
    """Draws each index as it is asked for (sampling with replacement): from the torch RNG, or ``generator``."""

    def __init__(self, size: int, generator: torch.Generator | None = None) -> None:
        self.size, self.generator = size, generator

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.size):
            yield int(torch.randint(self.size, (), generator=self.generator))


def test_dataloader_workers_say_a_sampler_drawing_as_it_yields_is_read_ahead(tmp_path: Path) -> None:
    # The workers prefetch (2 batches each): the sampler's draws from the torch RNG come before Dropout's, from the
    # first step, even without persistent workers, where the advice said training was the same bit for bit.
    data = dataset_for("cnn", 64)

    def build() -> pl.LightningModule:
        return Classifier(dropout_mlp(), OPTIMIZERS["adam"])

    def drawn(generator: Callable[[], torch.Generator | None] = lambda: None, **options: Any) -> DataLoader[Any]:
        return DataLoader(data, batch_size=16, sampler=Drawing(64, generator()), **options)

    monitored = fit(tmp_path, build, drawn, steps=8, monitored=True)
    assert monitored.report is not None
    waiting = replace(
        monitored.report.summary,
        data_wait_fraction=0.5,
        recent_data_wait_fraction=0.5,
        step_seconds_median=1.0,
        timed_steps=100,
    )
    setup = replace(training_setup(build(), [], dataloaders=drawn()), cpu_cores_per_device=3)
    advice = dataloader_workers(waiting, setup)
    assert advice is not None
    assert "unless a sampler of yours draws from the torch RNG as it yields indices" in advice.detail
    assert "a torch.Generator of its own keeps it apart" in advice.detail
    arguments = {**printed_loader_arguments(advice), "persistent_workers": False}
    plain = fit(tmp_path, build, drawn, steps=8)
    assert fit(tmp_path, build, lambda: drawn(**arguments), steps=8).losses[0] != plain.losses[0]
    # With a generator of its own, as the advice says, the workers train the same model, bit for bit.
    own = partial(torch.Generator().manual_seed, 7)
    assert_identical(
        fit(tmp_path, build, lambda: drawn(own, **arguments), steps=8),
        fit(tmp_path, build, lambda: drawn(own), steps=8),
    )


class Curriculum(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 labelled 3 x 8 x 8 images scaled by a level the module raises at each epoch's start (a curriculum)."""

    def __init__(self) -> None:
        self.data = dataset_for("cnn", 64)
        self.level = 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.data[index]
        return images * (1 + self.level), labels


class Staged(Classifier):
    """Sets the training dataset's level to the epoch at each epoch's start."""

    def on_train_epoch_start(self) -> None:
        self.trainer.train_dataloader.dataset.level = self.current_epoch  # type: ignore[union-attr]


def test_dataloader_workers_say_persistent_workers_miss_a_dataset_changed_between_epochs(tmp_path: Path) -> None:
    # No random draw anywhere (no shuffle, Dropout or augmentation): what persistent workers change here is the data.
    # They keep the dataset they forked with, level 0, so from the second epoch they load other samples than the
    # main process would; the advice said only "The same computation, but not the same random numbers".
    def build() -> pl.LightningModule:
        return Staged(nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 10)), OPTIMIZERS["adam"])

    def staged(**options: Any) -> DataLoader[Any]:
        return DataLoader(Curriculum(), batch_size=16, **options)

    monitored = fit(tmp_path, build, staged, steps=12, monitored=True)
    assert monitored.report is not None
    waiting = replace(
        monitored.report.summary,
        data_wait_fraction=0.5,
        recent_data_wait_fraction=0.5,
        step_seconds_median=1.0,
        timed_steps=100,
    )
    setup = replace(training_setup(build(), [], dataloaders=staged()), cpu_cores_per_device=3)
    advice = dataloader_workers(waiting, setup)
    assert advice is not None
    assert "where your code changes the dataset between epochs" in advice.detail
    assert "leave persistent_workers out there" in advice.detail
    arguments = printed_loader_arguments(advice)
    plain = fit(tmp_path, build, staged, steps=12)
    applied = fit(tmp_path, build, lambda: staged(**arguments), steps=12)
    assert applied.losses[:4] == plain.losses[:4]
    assert applied.losses[4:] != plain.losses[4:]  # level 0's samples again
    # Left out, as the advice says: the workers start again each epoch, with the dataset at its level.
    arguments["persistent_workers"] = False
    assert_identical(fit(tmp_path, build, lambda: staged(**arguments), steps=12), plain)


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 labelled 3 x 8 x 8 images read one after another, as a stream of files or records is."""

    def __init__(self) -> None:
        self.data = dataset_for("cnn", 64)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(len(self.data)):
            yield self.data[index]


def sample_ids(loader: DataLoader[Any]) -> list[list[int]]:
    """One epoch of ``loader``'s batches, each as the indices of its samples in :class:`Stream`'s data."""
    first = Stream().data.tensors[0].flatten(1)[:, 0].tolist()
    return [[first.index(value) for value in images.flatten(1)[:, 0].tolist()] for images, _ in loader]


@pytest.mark.parametrize("drop_last", [False, True], ids=["all-batches", "drop_last"])
def test_dataloader_workers_on_an_iterable_dataset_print_the_split_that_keeps_one_process_batches(
    tmp_path: Path, drop_last: bool
) -> None:
    # Each worker runs its own copy of an IterableDataset's __iter__: the printed arguments alone would have each of
    # the 2 workers yield the whole stream, 8 batches an epoch of 4. Split sample by sample (the code printed before),
    # each worker batched its own share: other batches, and under drop_last each worker dropped its own partial
    # batch (batches of 12: 48 of 64 samples an epoch where one process saw 60), against "each sample is still seen
    # once an epoch". Split by runs of the batch size, the workers' batches taken in turn are one process's.
    batch_size = 12 if drop_last else 16

    def build() -> pl.LightningModule:
        return Classifier(dropout_mlp(), OPTIMIZERS["adam"])

    def streamed(**options: Any) -> DataLoader[Any]:
        return DataLoader(Stream(), batch_size=batch_size, drop_last=drop_last, **options)

    monitored = fit(tmp_path, build, streamed, steps=4, monitored=True)
    assert monitored.report is not None
    waiting = replace(
        monitored.report.summary,
        data_wait_fraction=0.5,
        recent_data_wait_fraction=0.5,
        step_seconds_median=1.0,
        timed_steps=100,
    )
    setup = replace(training_setup(build(), [], dataloaders=streamed()), cpu_cores_per_device=3)
    assert setup.iterable_dataset and setup.loader_batch_size == batch_size
    advice = dataloader_workers(waiting, setup)
    assert advice is not None
    assert "every worker yields every sample and an epoch holds each batch 2 times" in advice.detail
    assert "every batch, their order and what drop_last drops stay as in one process" in advice.detail
    split, line = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    arguments = printed_loader_arguments(replace(advice, detail=f"```python\n{line}\n```"))
    assert arguments == {"num_workers": 2, "persistent_workers": True}
    plain = sample_ids(streamed())
    assert len(sample_ids(streamed(**arguments))) == 2 * len(plain)  # what the arguments alone do

    namespace: dict[str, Any] = {"torch": torch}
    exec(split, namespace)  # the printed __iter__, as printed

    class Split(Stream):
        samples = Stream.__iter__
        __iter__ = namespace["__iter__"]

    def split_loader(**options: Any) -> DataLoader[Any]:
        return DataLoader(Split(), batch_size=batch_size, drop_last=drop_last, **options)

    # before: [[0, 2, ..., 22], [1, 3, ..., 23], ...], and under drop_last 48 samples where one process took 60
    assert sample_ids(split_loader(**arguments)) == plain
    assert sample_ids(split_loader()) == plain  # one process: the stream as it was
    steps = len(plain)  # one epoch: persistent workers draw their seed as one process does its first
    assert_identical(
        fit(tmp_path, build, lambda: split_loader(**arguments), steps=steps),
        fit(tmp_path, build, streamed, steps=steps),
    )


# ------------------------------------------------------------------------------------------------ pin-memory


def test_pinned_memory_as_printed_trains_the_same_model(tmp_path: Path) -> None:
    # Pinning changes how batches are copied to the GPU, never their values. The Trainer here runs on the CPU: the
    # DataLoader pins nothing without an accelerator (it warns so); this pins the printed argument and the claim.
    data = dataset_for("cnn", 64)

    def build() -> pl.LightningModule:
        return Classifier(dropout_mlp(), OPTIMIZERS["adam"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 16), steps=6, monitored=True)
    assert monitored.report is not None
    waiting = replace(
        monitored.report.summary,
        device=DeviceInfo("cuda", "GPU", 0, 80 * 2**30, (8, 0)),
        data_wait_fraction=0.5,
        recent_data_wait_fraction=0.5,
        step_seconds_median=1.0,
        timed_steps=100,
    )
    advice = pin_memory(waiting, training_setup(build(), [], dataloaders=shuffled(data, 16)))
    assert advice is not None and "training is unchanged, bit for bit" in advice.detail
    arguments = printed_loader_arguments(advice)
    assert arguments == {"pin_memory": True}
    plain = fit(tmp_path, build, lambda: shuffled(data, 16), steps=6)
    assert_identical(monitored, plain)
    without_accelerator = pytest.warns(UserWarning, match="pin_memory")
    with contextlib.nullcontext() if torch.cuda.is_available() else without_accelerator:
        applied = fit(tmp_path, build, lambda: shuffled(data, 16, **arguments), steps=6)
    assert_identical(applied, plain)


# ------------------------------------------------------------------------------------------------ batch-size-headroom


def test_larger_batch_as_printed_says_it_changes_training(tmp_path: Path) -> None:
    # Unlike the memory-only rules, a larger batch trains another model: fewer, larger steps, BatchNorm's statistics
    # over more samples. The advice says so, and applied it does.
    data = dataset_for("cnn", 256)

    def build() -> pl.LightningModule:
        return Classifier(cnn_net(), OPTIMIZERS["adam"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 16), steps=4, monitored=True)
    assert monitored.report is not None and monitored.report.peak is not None
    idle = replace(
        monitored.report.summary,
        device=DeviceInfo("cuda", "GPU", 0, 4 * monitored.report.peak.peak_bytes, (8, 0)),
        cuda_context_bytes=0,
        gpu_utilization_mean=20.0,
        data_wait_fraction=0.0,
    )
    advice = batch_size_headroom(idle, training_setup(build(), []))
    assert advice is not None and "it trains another model" in advice.detail
    arguments = printed_loader_arguments(advice)
    larger = arguments.pop("batch_size")
    assert arguments == {} and 32 <= larger <= 256
    applied = fit(tmp_path, build, lambda: shuffled(data, larger), steps=4)
    plain = fit(tmp_path, build, lambda: shuffled(data, 16), steps=4)
    assert_identical(monitored, plain)
    assert applied.losses != plain.losses
    assert not torch.equal(applied.state["network.1.running_mean"], plain.state["network.1.running_mean"])


# ------------------------------------------------------------------------------------------------ optimizer-state


def test_optimizer_state_says_which_options_train_another_model(tmp_path: Path) -> None:
    # A wide MLP under Adam on a small batch: its two moments per parameter are the largest part of the peak. The
    # options swap the optimizer (8-bit Adam, SGD): not a memory-only change, and the advice says so.
    data = dataset(512, 64)

    def build() -> pl.LightningModule:
        return Classifier(mlp(512, 2, activation=nn.ReLU), OPTIMIZERS["adam"])

    monitored = fit(tmp_path, build, lambda: shuffled(data, 4), steps=3, monitored=True)
    advice = advice_of(monitored.report, "optimizer-state")
    assert "8-bit Adam rounds the moments and SGD is another update: either trains another model" in advice.detail
    assert "Sharding keeps the update exact" not in advice.detail  # one device: no sharding offered
    assert_identical(monitored, fit(tmp_path, build, lambda: shuffled(data, 4), steps=3))
