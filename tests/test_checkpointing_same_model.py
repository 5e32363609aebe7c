"""Checkpointing advice applied as printed trains the same model: BatchNorm's statistics included.

A checkpointed unit re-runs its forward in backward; a train-mode BatchNorm in it would update its running
statistics twice a step (pytorch/pytorch#96136). The printed code recomputes on copies of the buffers. Each model
here (a ResNet-style CNN with BatchNorm and inplace ReLUs, a small U-Net, the quickstart's CNN with Dropout) is
trained for a few steps with and without the printed code: losses, weights, buffers (running statistics,
``num_batches_tracked``) and the RNG state must be bit-identical, and the saving the replay predicted must show.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import ResidualBlocks, ResNetStyle, images
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.advice.checkpoint_code import KEEPING_BUFFERS, checkpoint_snippet
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.savings import change_key
from lightning_vram.advice.time_cost import predicted_step_seconds
from lightning_vram.records import Advice, CheckpointChange, CheckpointPlan

pytestmark = pytest.mark.replay  # the advice and its saving come from the replay


def conv_block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
        nn.BatchNorm2d(outputs),
        nn.ReLU(inplace=True),
        nn.Conv2d(outputs, outputs, 3, padding=1, bias=False),
        nn.BatchNorm2d(outputs),
        nn.ReLU(inplace=True),
    )


class SmallUNet(nn.Module):
    """Two levels down and up with skip connections, conv-BN-ReLU(inplace) blocks, Dropout at the bottom."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.down1 = conv_block(3, width)
        self.down2 = conv_block(width, 2 * width)
        self.bottom = nn.Sequential(conv_block(2 * width, 4 * width), nn.Dropout2d(0.2))
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = conv_block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = conv_block(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        first = self.down1(inputs)
        second = self.down2(nn.functional.max_pool2d(first, 2))
        bottom = self.bottom(nn.functional.max_pool2d(second, 2))
        x = self.dec2(torch.cat([self.up2(bottom), second], dim=1))
        x = self.dec1(torch.cat([self.up1(x), first], dim=1))
        return self.head(x).mean(dim=(2, 3))  # type: ignore[no-any-return]


def quickstart_cnn() -> nn.Sequential:
    """The quickstart's features (conv, BatchNorm, ReLU, pooling twice), Dropout, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


# ------------------------------------------------------------------------------------------ the printed code, applied


class Originals:
    """The modules a printed line names (``self.layer1[0].bn1``), as they were before the plan replaced them."""

    def __init__(self, modules: dict[str, nn.Module], prefix: str) -> None:
        self._modules = modules
        self._prefix = prefix

    def _at(self, part: str) -> Any:
        name = f"{self._prefix}.{part}" if self._prefix else part
        return self._modules.get(name) or Originals(self._modules, name)

    def __getattr__(self, part: str) -> Any:
        return self._at(part)

    def __getitem__(self, index: int) -> Any:
        return self._at(str(index))


def printed_forward(lines: list[str], printed: dict[str, Any]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``lines`` (the advice's, for a forward) as a function of ``self`` and ``x``, returning ``x``."""
    body = "".join(f"    {line}\n" for line in lines)
    exec(f"def printed_forward(self, x):\n{body}    return x\n", printed)
    return printed.pop("printed_forward")  # type: ignore[no-any-return]


class PrintedLine(nn.Module):
    """Stands where a unit's first module was and runs the advice's printed line for the unit, ``x = ...``."""

    def __init__(
        self, line: Callable[[Any, torch.Tensor], torch.Tensor], originals: Originals, modules: list[nn.Module]
    ) -> None:
        super().__init__()
        self.line = line
        self.originals = originals
        self.unit = nn.ModuleList(modules)  # registered here: the state_dict keeps them (as `unit.N`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.line(self.originals, x)


def apply_printed(module: nn.Module, plan: CheckpointPlan, code: str) -> None:
    """Apply ``code`` (the advice's, as printed) to ``module`` (the LightningModule): the definitions, then the lines.

    Lines for the LightningModule's ``__init__`` run on it; lines for a forward replace the calls they stand for.
    """
    definitions, _, comment_and_lines = code.partition("\n# in ")
    printed: dict[str, Any] = {}
    exec(definitions, printed)
    lines = comment_and_lines.split("\n")[1:]
    lines = [line for line in lines if line and not line.startswith("#")]
    if "__init__" in comment_and_lines.split("\n")[0]:
        exec("\n".join(lines), {**printed, "self": module})
        return
    forward_of = module.get_submodule(plan.forward_of or "")
    if plan.sequential_segments is not None:
        container = module.get_submodule(plan.container)
        container.forward = functools.partial(printed_forward(lines, printed), forward_of)  # type: ignore[method-assign]
        return
    prefix = f"{plan.forward_of}." if plan.forward_of else ""
    named = {name: module.get_submodule(name) for unit in plan.units for name in unit}
    originals = Originals({name.removeprefix(prefix): named[name] for name in named}, "")
    assert len(lines) == len(plan.units)
    for unit, line in zip(plan.units, lines, strict=True):
        line_forward = printed_forward([line], printed)
        module.set_submodule(unit[0], PrintedLine(line_forward, originals, [named[name] for name in unit]))
        for name in unit[1:]:
            module.set_submodule(name, nn.Identity())


# ------------------------------------------------------------------------------------------------ training, compared


@dataclass(frozen=True)
class Trained:
    losses: list[torch.Tensor]
    state: list[torch.Tensor]
    rng: torch.Tensor


def train(module: pl.LightningModule, data: TensorDataset, batch_size: int, steps: int) -> Trained:
    """``steps`` optimizer steps of the module's own training step and optimizer, from one seed."""
    torch.manual_seed(0)
    module.train()
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    losses = []
    for index, batch in zip(range(steps), loader(data, batch_size), strict=False):
        loss = module.training_step(batch, index)
        assert isinstance(loss, torch.Tensor)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    # Parameters and buffers in the order modules were built: wrapping renames the keys, not the order.
    return Trained(losses, [tensor.detach().clone() for tensor in module.state_dict().values()], torch.get_rng_state())


def assert_same(plain: Trained, applied: Trained) -> None:
    assert [loss.item() for loss in plain.losses] == [loss.item() for loss in applied.losses]
    assert len(plain.state) == len(applied.state)
    different = [index for index, (a, b) in enumerate(zip(plain.state, applied.state, strict=True)) if not a.equal(b)]
    assert different == []
    assert torch.equal(plain.rng, applied.rng)


def report_of(tmp_path: Path, module: pl.LightningModule, data: TensorDataset, batch_size: int) -> Report:
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(module, loader(data, batch_size))
    assert monitor.report is not None
    return monitor.report


def advised(report: Report) -> tuple[Advice, CheckpointPlan, str]:
    """The checkpointing advice, the plan it prints and its code block."""
    advice = next(advice for advice in report.advice if advice.id == "activation-checkpointing")
    match = re.search(r"```python\n(.*?)\n```", advice.detail, re.S)
    assert match is not None
    # One plan's code may begin another's (a range one unit shorter): the printed block is the one plan's exactly.
    plans = [plan for plan in checkpoint_candidates(report.summary.modules) if checkpoint_snippet(plan)[1] == match[1]]
    assert len(plans) == 1, advice.detail
    return advice, plans[0], match.group(1)


CASES: dict[str, tuple[Callable[[], nn.Module], int, str, str]] = {
    # stages of basic blocks after a stem: the stem and the last stage free nothing at the peak (backward recomputes
    # the last unit first, while all else is held), so the two stages before it, each wrapped where it is
    "resnet": (ResNetStyle, 32, "self.network.layer1 = Checkpointed(self.network.layer1)\n", "sgd"),
    # the same with four blocks as the model's own attributes and SGD with momentum: the three blocks before the last
    "resnet-blocks": (ResidualBlocks, 32, "self.network.block3 = Checkpointed(self.network.block3)", "sgd_momentum"),
    "unet": (SmallUNet, 16, "checkpoint_keeping_buffers(", "sgd"),
    # the quickstart's kind: an nn.Sequential in segments
    "quickstart": (quickstart_cnn, 32, "for start, end in (", "sgd"),
}
STEM = "x = checkpoint_keeping_buffers([self.bn1, self.relu], lambda t: self.relu("
"""A stem's bn1 with its inplace relu, printed in the forward as one unit: the best plan by modelled saving of the
ResNet cases (it checkpoints the stem and every stage), not the one advised."""


def classifier(case: str) -> Classifier:
    make_network, _, _, optimizer = CASES[case]
    return Classifier(make_network(), OPTIMIZERS[optimizer])


def trained(
    case: str, data: TensorDataset, batch_size: int, plan: CheckpointPlan | None = None, code: str = ""
) -> Trained:
    """Case ``case``'s model from seed 1, with ``plan``'s ``code`` applied as printed, trained for six steps."""
    torch.manual_seed(1)
    module = classifier(case)
    if plan is not None:
        apply_printed(module, plan, code)
    return train(module, data, batch_size, steps=6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpointing_advice_as_printed_trains_the_same_model(tmp_path: Path, case: str) -> None:
    _, batch_size, printed, _ = CASES[case]
    data = images(batch_size * 6, size=32 if case == "quickstart" else 16)
    before = report_of(tmp_path, classifier(case), data, batch_size)
    advice, plan, code = advised(before)
    assert printed in code and KEEPING_BUFFERS in code
    # The step time printed is the advised plan's own replay's, not another plan's replayed to the same peak.
    assert before.simulation is not None and before.simulation.baseline is not None
    key = change_key(CheckpointChange(plan))
    (own,) = [variant for variant in before.simulation.variants if change_key(variant.change) == key]
    assert own.replayed is not None
    step_seconds = before.summary.step_seconds_median
    assert advice.predicted_step_seconds == predicted_step_seconds(
        own.change, before.simulation.baseline, own.replayed, step_seconds, before.summary.device
    )
    assert any(
        "BatchNorm" in profile.type
        for unit in plan.units
        for profile in before.summary.modules
        if any(profile.name == name or profile.name.startswith(f"{name}.") for name in unit)
    )

    plain = trained(case, data, batch_size)
    assert_same(plain, trained(case, data, batch_size, plan, code))
    if case.startswith("resnet"):
        # The modelled best plan's code, a stem unit printed in the forward, trains the same model too.
        best = checkpoint_candidates(before.summary.modules)[0]
        best_code = checkpoint_snippet(best)[1]
        assert STEM in best_code and best != plan
        assert_same(plain, trained(case, data, batch_size, best, best_code))

    # The saving the replay predicted shows when the printed code runs.
    torch.manual_seed(1)
    module = classifier(case)
    apply_printed(module, plan, code)
    after = report_of(tmp_path, module, data, batch_size)
    assert advice.estimated_saving_bytes is not None and before.peak is not None and after.peak is not None
    realised = before.peak.peak_bytes - after.peak.peak_bytes
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.01)
    assert [advice.id for advice in after.advice if advice.id == "activation-checkpointing"] == []


def test_plain_checkpointing_counts_batchnorm_twice() -> None:
    """Why: torch's checkpoint re-runs a BatchNorm's forward in backward, updating its statistics again."""
    norm = nn.BatchNorm2d(4)
    checkpoint(norm, torch.randn(2, 4, 3, 3, requires_grad=True), use_reentrant=False).sum().backward()
    assert norm.num_batches_tracked.item() == 2
