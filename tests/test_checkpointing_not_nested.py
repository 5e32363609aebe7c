"""Checkpointing advice on a model checkpointed already never wraps a checkpointed module again.

A new user's trial applied a memory-budget plan (``predict(..., memory_budget=...)``: a transformer encoder's layer in
``SelectivelyCheckpointed``), and the next run's checkpointing advice printed
``Checkpointed(self.network.encoder.layers[1])`` over the ``SelectivelyCheckpointed`` layer: two checkpoints nested,
the layer recomputed twice in backward, for nothing the plan without it does not free. On a ResNet-style model with
the blocks of every stage but the last in ``Checkpointed``, the advice checkpointed ``self.network.layer1`` around
its two wrapped blocks.

A module the sampled step recomputed in backward (the report's ``recomputed_units``: an applied plan's wrapper, torch's
``checkpoint_wrapper``) is no candidate, nor a module inside one or holding one: it keeps the checkpointing it has (the
budget plan chose selective checkpointing for it), and a range of layers around it checkpoints the others. Each model
here runs with the plan applied as the budget prints it; no replayed candidate nests, and the advice given, applied as
printed on top, realises its saving and trains the same model as the plain one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from advice_models import ResNetStyle, images
from models import Classifier
from test_checkpointing_same_model import Trained, apply_printed, assert_same, report_of, train
from test_memory_budget import Encoder, token_classes
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.data import TensorDataset

from lightning_vram import Report
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.records import CheckpointChange, CheckpointPlan

pytestmark = pytest.mark.replay  # the candidates and the advice's saving come from the replay

LAYERS = "network.encoder.layers"
SELECTIVE_LAYER = CheckpointPlan(LAYERS, ((f"{LAYERS}.1",),), None, 0, "network.encoder", selective=(f"{LAYERS}.1",))
"""A budget plan's: the encoder's second layer under selective checkpointing (what the trial had applied)."""
BLOCKS = CheckpointPlan(
    "network",
    tuple((f"network.layer{stage}.{block}",) for stage, block in ((1, 0), (1, 1), (2, 0), (2, 1), (3, 0))),
    None,
    0,
    "network.layer1",
)
"""The ResNet-style model's plan for half its peak: every block but the last in ``Checkpointed``."""


def printed(plan: CheckpointPlan) -> Callable[[Classifier], None]:
    """Applies ``plan``'s code as the budget plan prints it."""
    code = checkpoint_snippet(plan)[1]
    return lambda module: apply_printed(module, plan, code)


def torch_wrapper(module: Classifier) -> None:
    """The encoder's second layer in torch's own ``checkpoint_wrapper`` (non-reentrant)."""
    layers = module.network.encoder.layers
    assert isinstance(layers, nn.ModuleList)
    layers[1] = checkpoint_wrapper(layers[1])


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[Classifier], None], Callable[[], TensorDataset], int]] = {
    "encoder-selective": (Encoder, printed(SELECTIVE_LAYER), lambda: token_classes(6 * 16, 64), 16),
    "encoder-torch-wrapper": (Encoder, torch_wrapper, lambda: token_classes(6 * 16, 64), 16),
    "resnet-blocks": (ResNetStyle, printed(BLOCKS), lambda: images(6 * 32), 32),
}


def nests(plan: CheckpointPlan, recomputed: tuple[tuple[str, ...], ...]) -> list[str]:
    """The modules of ``plan`` that are, are inside or hold a module the step recomputed already."""

    def overlap(name: str, done: str) -> bool:
        return name == done or name.startswith(f"{done}.") or done.startswith(f"{name}.")

    return [
        name
        for unit in plan.units
        for name in unit
        if any(overlap(name, done) for unit_ in recomputed for done in unit_)
    ]


def replayed_plans(report: Report) -> list[CheckpointPlan]:
    assert report.simulation is not None
    return [
        variant.change.plan for variant in report.simulation.variants if isinstance(variant.change, CheckpointChange)
    ]


def model(case: str, advice: tuple[CheckpointPlan, str] | None = None) -> Classifier:
    """Case ``case``'s model from seed 1 with its plan applied (and ``advice``'s code as printed after it)."""
    make, apply, _, _ = CASES[case]
    torch.manual_seed(1)
    module = Classifier(make())
    apply(module)
    if advice is not None:
        apply_printed(module, *advice)
    return module


def trained(module: Classifier, case: str) -> Trained:
    _, _, make_data, batch_size = CASES[case]
    return train(module, make_data(), batch_size, steps=4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpointing_advice_never_wraps_a_checkpointed_module_again(tmp_path: Path, case: str) -> None:
    make, _, make_data, batch_size = CASES[case]
    data = make_data()
    before = report_of(tmp_path / "before", model(case), data, batch_size)
    recomputed = before.recomputed_units
    assert recomputed, "the applied plan's modules were not recomputed"
    candidates = replayed_plans(before)
    assert candidates
    # Main replayed (and for two of them advised) plans around the checkpointed layer or blocks.
    assert [nests(plan, recomputed) for plan in candidates if nests(plan, recomputed)] == []

    advice = next((advice for advice in before.advice if advice.id == "activation-checkpointing"), None)
    print(case, recomputed, advice and advice.title)
    if advice is None:
        return
    match = re.search(r"```python\n(.*?)\n```", advice.detail, re.S)
    assert match is not None
    (plan,) = [plan for plan in candidates if checkpoint_snippet(plan)[1] == match[1]]
    assert "Checkpointed(Checkpointed" not in match[1]

    # Applied as printed on top of the plan: the saving shows, and the model trained is the plain one's.
    after = report_of(tmp_path / "after", model(case, (plan, match[1])), data, batch_size)
    assert advice.estimated_saving_bytes is not None and before.peak is not None and after.peak is not None
    realised = before.peak.peak_bytes - after.peak.peak_bytes
    print(f"{case}: advised {advice.estimated_saving_bytes:,} B, realised {realised:,} B")
    assert realised == pytest.approx(advice.estimated_saving_bytes, rel=0.01)
    assert (
        after.recomputed_units is not None
        and [
            nests(plan, after.recomputed_units) for plan in replayed_plans(after) if nests(plan, after.recomputed_units)
        ]
        == []
    )
    torch.manual_seed(1)
    plain = Classifier(make())
    assert_same(trained(plain, case), trained(model(case, (plan, match[1])), case))


def test_a_step_checkpointed_throughout_is_told_why_no_plan_is_advised(tmp_path: Path) -> None:
    """Every layer in ``SelectivelyCheckpointed``: no candidate is left, and the reason names the step's checkpointing
    (main's named the largest saver, a checkpointed layer, as if nothing checkpointed it)."""
    every = tuple(f"{LAYERS}.{index}" for index in range(4))
    plan = CheckpointPlan(LAYERS, tuple((name,) for name in every), None, 0, "network.encoder", selective=every)
    torch.manual_seed(1)
    module = Classifier(Encoder())
    printed(plan)(module)
    report = report_of(tmp_path, module, token_classes(6 * 16, 64), 16)
    assert report.recomputed_units is not None and len(report.recomputed_units) == 4
    assert [nests(plan, report.recomputed_units) for plan in replayed_plans(report)] == []
    assert "activation-checkpointing" not in {advice.id for advice in report.advice}
    (reason,) = [item.reason for item in report.not_advised if item.id == "activation-checkpointing"]
    print(reason)
    assert f"but the step checkpoints 4 unit(s) already, 4 of them selectively, {LAYERS}." in reason
    assert "a checkpoint around or inside one would recompute it twice" in reason
