"""Time beside memory: each advised change's step-time cost, from the FLOPs its replay counted.

The replay counts FLOPs with torch's ``FlopCounterMode`` over the fake step; the checkpointing advice's FLOP ratio is
checked here against FLOPs counted on real tensors, independently: the plain step's and the forward of the units the
printed code recomputes. ``lightning-vram diff`` sets the predicted cost beside the measured step time of a run that
applied the advice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import ResNetStyle, images
from models import Classifier, loader
from test_checkpoint_idiom import ARCHITECTURES as TRANSFORMERS
from test_checkpoint_idiom import BATCH as TRANSFORMERS_BATCH
from test_checkpoint_idiom import _report as transformers_report
from test_checkpointing_same_model import advised, apply_printed, report_of
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers_models import FineTuned, data

from lightning_vram import Report
from lightning_vram.cli import main
from lightning_vram.codec import report_to_dict
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import Advice, AdviceId, CheckpointChange, CostBasis, ReplayedStep

pytestmark = pytest.mark.replay  # the costs come from the replay

BATCH = 32


def step_flops(module: pl.LightningModule, batch: Any) -> int:
    """FLOPs of one real training step (forward, backward, optimizer step), counted on real tensors."""
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    with FlopCounterMode(display=False) as counter:
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return counter.get_total_flops()


def forward_flops(module: pl.LightningModule, batch: Any, names: list[str]) -> int:
    """FLOPs of the forward of the submodules ``names`` (paths in ``module``) in one real forward pass."""
    with FlopCounterMode(display=False) as counter:
        module.training_step(batch, 0)
    counts = counter.get_flop_counts()
    return sum(sum(counts.get(_tracked_name(module, name, counts), {}).values()) for name in names)


def _tracked_name(module: nn.Module, name: str, counts: dict[str, Any]) -> str:
    """How FlopCounterMode names submodule ``name``: under the outermost module whose forward ran, by its class name.

    A module that ran no counted op (a BatchNorm, a ReLU) has no entry.
    """
    (root,) = [key for key in counts if "." not in key and key != "Global"]
    parts = name.split(".")
    for index in range(len(parts)):
        if type(module.get_submodule(".".join(parts[:index]))).__name__ == root:
            return ".".join([root, *parts[index:]])
    raise AssertionError(f"{name} is not inside {root}")


def checkpointing(report: Report) -> Advice:
    (advice,) = [item for item in report.advice if item.id is AdviceId.ACTIVATION_CHECKPOINTING]
    return advice


def assert_priced(report: Report, advice: Advice) -> None:
    """The advice's cost is its predicted step time less the run's median (they add up as printed), else the median
    times its FLOP ratio less one."""
    step_seconds = report.timing.step_seconds_median
    assert step_seconds is not None and advice.flop_ratio is not None
    assert advice.cost_basis is CostBasis.RECOMPUTED_FORWARD
    if advice.predicted_step_seconds is not None:
        expected = advice.predicted_step_seconds - step_seconds
    else:
        expected = step_seconds * (advice.flop_ratio - 1)
    assert advice.estimated_cost_seconds == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------------------- counting changes nothing


def _figures(step: ReplayedStep) -> tuple[Any, ...]:
    return step.phases, step.modules, step.loss_activation_bytes, step.timeline, step.notes


@pytest.mark.parametrize("kind", ["resnet", "gpt2"])
def test_counting_flops_leaves_every_figure_of_the_replay_as_it_was(kind: str) -> None:
    torch.manual_seed(0)
    if kind == "resnet":
        module: pl.LightningModule = Classifier(ResNetStyle())
        batch = next(iter(loader(images(8), 8)))
    else:
        module = FineTuned("gpt2")
        batch = next(iter(loader(data("gpt2", 64, 4), 4)))
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    predictor = Predictor(module, [optimizer], batch)
    plain, counted = predictor.replay(None), predictor.replay(None, count_flops=True)
    assert isinstance(plain, ReplayedStep) and isinstance(counted, ReplayedStep)
    assert _figures(counted) == _figures(plain)
    assert plain.flops is None
    assert counted.flops == step_flops(module, batch)  # the fake step's FLOPs are the real step's


def test_counting_flops_leaves_a_checkpointed_replay_as_it_was(
    resnet_runs: tuple[Report, Report, pl.LightningModule, Any],
) -> None:
    """Torch's FlopCounterMode tracks modules with gradient hooks that held gradients longer: here 28.6 KiB."""
    before, _, _, batch = resnet_runs
    _, plan, _ = advised(before)
    torch.manual_seed(1)
    module = Classifier(ResNetStyle())
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer)
    predictor = Predictor(module, [optimizer], batch)
    plain = predictor.replay(CheckpointChange(plan))
    counted = predictor.replay(CheckpointChange(plan), count_flops=True)
    assert isinstance(plain, ReplayedStep) and isinstance(counted, ReplayedStep)
    assert _figures(counted) == _figures(plain)
    baseline = predictor.replay(None, count_flops=True)
    assert isinstance(baseline, ReplayedStep) and baseline.flops is not None and counted.flops is not None
    assert counted.flops > baseline.flops


# ----------------------------------------------------------------------------------- the checkpointing advice's cost


@pytest.fixture(scope="module")
def resnet_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Report, pl.LightningModule, Any]:
    """The ResNet-style CNN with BatchNorm trained with the monitor, then again with the printed checkpointing code."""
    dataset = images(BATCH * 6)
    torch.manual_seed(1)
    before = report_of(tmp_path_factory.mktemp("before"), Classifier(ResNetStyle()), dataset, BATCH)
    _, plan, code = advised(before)
    torch.manual_seed(1)
    applied = Classifier(ResNetStyle())
    apply_printed(applied, plan, code)
    after = report_of(tmp_path_factory.mktemp("after"), applied, dataset, BATCH)
    return before, after, applied, next(iter(loader(dataset, BATCH)))


def test_a_cnn_s_checkpointing_cost_is_the_recomputed_forward_over_the_step(
    resnet_runs: tuple[Report, Report, pl.LightningModule, Any],
) -> None:
    before, _, applied, batch = resnet_runs
    advice, plan, _ = advised(before)
    assert_priced(before, advice)
    torch.manual_seed(1)
    plain = Classifier(ResNetStyle())
    step = step_flops(plain, batch)
    recomputed = forward_flops(plain, batch, [name for unit in plan.units for name in unit])
    assert recomputed > 0
    assert advice.flop_ratio == (step + recomputed) / step
    assert step_flops(applied, batch) == step + recomputed  # the printed code recomputes just that


@pytest.mark.parametrize("name", ["gpt2"])
def test_a_language_model_s_checkpointing_cost_is_its_layers_forward_over_the_step(tmp_path: Path, name: str) -> None:
    architecture = TRANSFORMERS[name]
    dataset = architecture.data(4 * TRANSFORMERS_BATCH)
    before = transformers_report(tmp_path, architecture.module(), dataset)
    advice = checkpointing(before)
    assert_priced(before, advice)
    module = architecture.module()
    batch = next(iter(loader(dataset, TRANSFORMERS_BATCH)))
    step = step_flops(module, batch)
    layers = [f"model.transformer.h.{index}" for index in range(len(module.model.transformer.h))]
    recomputed = forward_flops(module, batch, layers)
    assert advice.flop_ratio == (step + recomputed) / step


# -------------------------------------------------------------------------------------------------- shown and checked


def test_every_view_says_the_cost_and_the_report_keeps_it(
    resnet_runs: tuple[Report, Report, pl.LightningModule, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = resnet_runs[0]
    advice = checkpointing(before)
    assert advice.cost_text is not None and advice.estimated_cost_seconds is not None
    assert advice.flop_ratio is not None
    assert advice.cost_text == (
        f"costs about {1000 * advice.estimated_cost_seconds:+.1f} ms a step"
        f" ({advice.flop_ratio - 1:+.1%} FLOPs, recomputed forward)"
    )
    path = tmp_path / "before.json"
    path.write_text(json.dumps(report_to_dict(before)))
    written = next(item for item in json.loads(path.read_text())["advice"] if item["id"] == "activation-checkpointing")
    assert written["estimated_cost_seconds"] == advice.estimated_cost_seconds
    assert written["flop_ratio"] == advice.flop_ratio and written["cost_basis"] == "recomputed forward"
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert advice.cost_text in " ".join(shown.split())  # the console folds long lines
    assert main(["html", str(path), "-o", str(tmp_path / "page.html")]) == 0
    assert f"<strong>Time cost:</strong> {advice.cost_text}" in (tmp_path / "page.html").read_text()


def test_diff_sets_the_predicted_cost_beside_the_measured_step_time(
    resnet_runs: tuple[Report, Report, pl.LightningModule, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after, _, _ = resnet_runs
    advice = checkpointing(before)
    paths = []
    for name, report in (("a", before), ("b", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report_to_dict(report)))
    assert main(["diff", *map(str, paths)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [line for line in lines if line.startswith("step time (activation-checkpointing): ")]
    assert advice.estimated_cost_seconds is not None and advice.flop_ratio is not None
    predicted = f"A's replay predicted {1000 * advice.estimated_cost_seconds:+.1f} ms a step"
    assert f"{predicted} ({advice.flop_ratio - 1:+.1%} FLOPs, recomputed forward), B's median step took " in line
    assert re.search(
        r"; the cost measured [+-]\d+\.\d ms for [+-]\d+\.\d ms predicted: (within|outside) the tolerance of 25\.0% or"
        r" 1 ms(; predicted step with the change \d+\.\d ms)?; step times vary \(",
        line,
    ), line
    # A report from before the time cost, or a run that applied nothing: no time line.
    for after_report in (before,):
        paths[1].write_text(json.dumps(report_to_dict(after_report)))
        assert main(["diff", *map(str, paths)]) == 0
        assert not any(line.startswith("step time (") for line in capsys.readouterr().out.splitlines())
