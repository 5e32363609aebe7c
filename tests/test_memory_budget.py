"""A memory budget's checkpointing plan, applied as printed: the step fits as predicted, and trains the same model.

``predict(module, batch, memory_budget=...)`` chooses what to checkpoint; each model here (a ResNet-style CNN with
BatchNorm and inplace ReLUs, a transformer encoder with dropout, a GPT-2 from transformers' config) gets a budget
between its unchanged peak and its fully checkpointed one, the printed code is applied as printed, and the model is
trained on the CPU: the measured peak is at or under the budget and within 3% of the plan's predicted peak, and
losses, weights, buffers and the RNG state are bit-identical to training without the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import ResNetStyle, images
from models import REPLAYS_OFF, Classifier, loader, trainer
from test_checkpointing_same_model import Trained, apply_printed, assert_same, train
from torch import nn
from torch.utils.data import TensorDataset
from transformers_models import VOCAB, FineTuned

from lightning_vram import VramMonitor, predict
from lightning_vram.advice.budget import plan_for_budget
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import ReplayedStep
from lightning_vram.records.budget import BudgetPlan

pytestmark = pytest.mark.replay  # predict() replays

MIB = 2**20


class Encoder(nn.Module):
    """Token embeddings, a 4-layer ``nn.TransformerEncoder`` (dropout on), mean pooling, a classifier head."""

    def __init__(self, width: int = 32, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=4 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))  # type: ignore[no-any-return]


def token_classes(samples: int, length: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randint(0, VOCAB, (samples, length), generator=generator),
        torch.randint(0, 10, (samples,), generator=generator),
    )


def gpt2(layers: int = 4) -> FineTuned:
    """A GPT-2 LM of ``layers`` blocks, 64 wide, from its config (no download), trained without a key/value cache."""
    import transformers

    module = FineTuned("gpt2")
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    config.use_cache = False
    module.model = transformers.GPT2LMHeadModel(config)
    return module


def gpt2_data(samples: int, length: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randint(0, VOCAB, (samples, length), generator=generator), torch.ones(samples, length, dtype=torch.long)
    )


CASES: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[], TensorDataset], int]] = {
    "resnet": (lambda: Classifier(ResNetStyle()), lambda: images(6 * 32), 32),
    "encoder": (lambda: Classifier(Encoder()), lambda: token_classes(6 * 16, 64), 16),
    "gpt2": (gpt2, lambda: gpt2_data(6 * 8, 64), 8),
}


def first_batch(data: TensorDataset, batch_size: int) -> Any:
    return next(iter(loader(data, batch_size)))


def measured_peak(tmp_path: Path, module: pl.LightningModule, data: TensorDataset, batch_size: int) -> int:
    """The CPU live peak the monitor measures on a sampled step of a short run (no replays)."""
    monitor = VramMonitor(
        attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, **REPLAYS_OFF
    )
    trainer(tmp_path, [monitor], max_steps=3).fit(module, loader(data, batch_size))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report.peak.peak_bytes


def budget_plan(module: nn.Module, batch: Any, memory_budget: int | str) -> BudgetPlan:
    prediction = predict(module, batch, device_type="cpu", fit_table=False, memory_budget=memory_budget)
    assert prediction.budget is not None, prediction
    return prediction.budget


@pytest.mark.parametrize("case", sorted(CASES))
def test_budget_plan_as_printed_fits_as_predicted_and_trains_the_same(tmp_path: Path, case: str) -> None:
    check_budget_plan(tmp_path, case, 0.85)


def test_a_budget_no_stage_meets_alone_is_met_by_blocks_of_several_stages(tmp_path: Path) -> None:
    """Half the ResNet-style model's peak: checkpointing whole stages, or the blocks of any one stage, peaks above it
    (the search said "no plan fits" with a smallest peak 63.4 KiB over); blocks of every stage meet it."""
    found = check_budget_plan(tmp_path, "resnet", 0.5)
    assert found.plan is not None
    stages = {unit[0].rpartition(".")[0] for unit in found.plan.units}
    assert len(stages) >= 2 and all(stage.startswith("network.layer") for stage in stages), found.plan.units


@functools.cache
def unchanged_peak(case: str) -> int:
    """The case's replayed peak without a plan, bytes (replayed once for every budget asked of the case)."""
    make, make_data, batch_size = CASES[case]
    torch.manual_seed(1)
    baseline = predict(make(), first_batch(make_data(), batch_size), device_type="cpu", fit_table=False)
    assert baseline.step is not None
    return baseline.step.peak.peak_bytes


@functools.cache
def trained_without_a_plan(case: str) -> Trained:
    """The case's model trained 4 steps as built (trained once for every plan it is compared with)."""
    make, make_data, batch_size = CASES[case]
    torch.manual_seed(1)
    return train(make(), make_data(), batch_size, steps=4)


def check_budget_plan(tmp_path: Path, case: str, share: float) -> BudgetPlan:
    """The budget plan for ``share`` of the unchanged replayed peak, applied as printed: it fits as predicted (the
    sampled step's measured live peak within 3%) and trains the same."""
    make, make_data, batch_size = CASES[case]
    data = make_data()
    unchanged = unchanged_peak(case)
    budget = int(unchanged * share)
    torch.manual_seed(1)
    found = budget_plan(make(), first_batch(data, batch_size), budget)
    print(f"{case}: unchanged {unchanged:,} B, budget {budget:,} B;", *found.lines(), sep="\n")
    assert found.fits and found.plan is not None and found.code is not None and found.peak_bytes is not None
    assert found.peak_bytes <= budget
    assert found.step_flops is not None and found.recomputed_flops is not None
    assert 0 <= found.recomputed_flops < found.step_flops

    torch.manual_seed(1)
    applied = make()
    apply_printed(applied, found.plan, found.code)
    measured = measured_peak(tmp_path, applied, data, batch_size)
    print(f"{case}: measured {measured:,} B, predicted {found.peak_bytes:,} B")
    assert measured <= budget
    assert measured == pytest.approx(found.peak_bytes, rel=0.03)

    torch.manual_seed(1)
    applied = make()
    apply_printed(applied, found.plan, found.code)
    assert_same(trained_without_a_plan(case), train(applied, data, batch_size, steps=4))
    return found


def test_a_budget_already_met_needs_no_checkpointing() -> None:
    torch.manual_seed(1)
    found = budget_plan(Classifier(ResNetStyle()), first_batch(images(32), 32), "1GiB")
    assert found.fits and found.plan is None and found.code is None
    assert found.recomputed_flops == 0 and found.replays == 1
    assert found.peak_bytes == found.baseline_peak_bytes < 2**30
    assert "without checkpointing" in found.reason


def test_a_budget_below_every_plan_says_so_with_the_smallest_peak_reached() -> None:
    torch.manual_seed(1)
    found = budget_plan(Classifier(ResNetStyle()), first_batch(images(32), 32), 1 * MIB)
    assert not found.fits and found.plan is None and found.code is None
    assert found.peak_bytes is not None and 1 * MIB < found.peak_bytes < found.baseline_peak_bytes
    assert "the smallest peak the search reached is" in found.reason and "over the budget" in found.reason
    # It says what it searched (a trial found a plan across several modules' children that peaked lower).
    assert "it tries the children of one module at a time, and the layers of several stacks" in found.reason
    assert "no plan fits" in "\n".join(found.lines())


@pytest.mark.parametrize("bad", ["lots", "20 parsecs", 0, -1, 1.5, True, "0GiB"])
def test_a_bad_memory_budget_is_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
        predict(Classifier(ResNetStyle()), first_batch(images(4), 4), device_type="cpu", memory_budget=bad)  # type: ignore[arg-type]


def test_whole_units_only_plan_as_printed_fits_as_predicted_and_trains_the_same(tmp_path: Path) -> None:
    """The transformer encoder's plan without selective checkpointing: whole layers in the ``Checkpointed`` wrapper."""
    data = token_classes(6 * 16, 64)
    batch = first_batch(data, 16)
    torch.manual_seed(1)
    predictor = Predictor(Classifier(Encoder()), None, batch, placement=torch.device("cpu"), warm_up=True)
    baseline = predictor.replay(None, count_flops=True)
    assert isinstance(baseline, ReplayedStep)
    budget = int(baseline.peak.peak_bytes * 0.8)
    found = plan_for_budget(predictor, budget, baseline, selective=False)
    assert isinstance(found, BudgetPlan) and found.plan is not None and found.code is not None
    print(*found.lines(), sep="\n")
    assert found.plan.selective == () and "SelectivelyCheckpointed" not in found.code
    assert found.peak_bytes is not None and found.peak_bytes <= budget
    assert found.recomputed_flops is not None and found.recomputed_flops > 0

    torch.manual_seed(1)
    applied = Classifier(Encoder())
    apply_printed(applied, found.plan, found.code)
    measured = measured_peak(tmp_path, applied, data, 16)
    assert measured <= budget and measured == pytest.approx(found.peak_bytes, rel=0.03)
    torch.manual_seed(1)
    plain = Classifier(Encoder())
    torch.manual_seed(1)
    applied = Classifier(Encoder())
    apply_printed(applied, found.plan, found.code)
    assert_same(train(plain, data, 16, steps=4), train(applied, data, 16, steps=4))


def test_the_prediction_prints_and_writes_its_budget_plan() -> None:
    torch.manual_seed(1)
    data = token_classes(16, 64)
    prediction = predict(
        Classifier(Encoder()), first_batch(data, 16), device_type="cpu", fit_table=False, memory_budget="20MiB"
    )
    assert prediction.budget is not None and prediction.budget.plan is not None
    text = str(prediction)
    assert "Memory budget 20.0 MiB (live peak):" in text and "checkpoint " in text
    written = prediction.to_dict()["budget"]
    assert written["budget_bytes"] == 20 * MIB and written["fits"] is True
    assert written["plan"]["units"] == [list(unit) for unit in prediction.budget.plan.units]
    assert written["plan"]["selective"] == list(prediction.budget.plan.selective)
    assert written["recompute_seconds"] == prediction.budget.recompute_seconds is not None
    assert "recomputation predicted to take" in text
    assert written["peak_bytes"] == prediction.budget.peak_bytes <= 20 * MIB
    # print(prediction.budget) gives the plan's lines, as docs/planning.md shows it (a trial met the record's repr).
    assert str(prediction.budget) == "\n".join(prediction.budget.lines()) and str(prediction.budget) in text


def test_a_search_cut_by_budget_seconds_says_so() -> None:
    now = [0.0]
    batch = first_batch(images(32), 32)
    torch.manual_seed(1)
    predictor = Predictor(
        Classifier(ResNetStyle()), None, batch, placement=torch.device("cpu"), budget_seconds=10.0, clock=lambda: now[0]
    )
    baseline = predictor.replay(None, count_flops=True)
    assert isinstance(baseline, ReplayedStep)
    now[0] = 11.0  # the budget of seconds is spent: no plan is replayed
    found = plan_for_budget(predictor, baseline.peak.peak_bytes // 2, baseline)
    assert isinstance(found, BudgetPlan) and not found.fits and found.replays == 1 and found.peak_bytes is None
    assert found.reason.startswith("no checkpointing plan could be replayed (0 container(s) searched)")
    assert found.reason.endswith("(the search stopped when budget_seconds ran out, after 1 replays)")
