"""What a replayed step asks of a device: each op's FLOPs, bytes moved, phase and recomputation (``ReplayedStep.work``).

The counts are checked against figures worked out by hand for a small MLP and against torch's ``FlopCounterMode``
on real tensors, and the counting is checked to leave every memory figure of the replay as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from models import OPTIMIZERS, Classifier
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import CheckpointChange, CheckpointPlan, Phase, ReplayedStep, StepChange

FLOAT = 4
"""Bytes of an fp32 element."""


def mlp() -> tuple[Classifier, Any]:
    """Linear(16, 8), ReLU, Linear(8, 4) with SGD, and a batch of 32."""
    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), OPTIMIZERS["sgd"])
    return module, (torch.randn(32, 16), torch.randint(0, 4, (32,)))


def replayed(module: Classifier, batch: Any, change: StepChange | None = None, count: bool = True) -> ReplayedStep:
    predictor = Predictor(module, None, batch, placement=torch.device("cpu"), warm_up=True)
    with round_of_replays():
        step = predictor.replay(change, count_flops=count)
    assert isinstance(step, ReplayedStep), step
    return step


def real_flops(module: Classifier, batch: Any) -> tuple[int, int]:
    """(forward, backward) FLOPs of one real step, by torch's own FlopCounterMode."""
    with FlopCounterMode(display=False) as forward:
        loss = module.training_step(batch, 0)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def test_each_phase_counts_the_flops_torch_counts_on_real_tensors() -> None:
    module, batch = mlp()
    step = replayed(module, batch)
    work = step.work
    assert work is not None
    forward, backward = real_flops(module, batch)
    print(f"forward {work.in_phase(Phase.FORWARD).flops} FLOPs, backward {work.in_phase(Phase.BACKWARD).flops}")
    assert work.flops == step.flops
    assert work.in_phase(Phase.FORWARD).flops == forward == 2 * 32 * (16 * 8 + 8 * 4)
    # backward: the second layer's input and weight gradients, the first layer's weight gradient only
    assert work.in_phase(Phase.BACKWARD).flops == backward == 2 * 32 * (8 * 4 + 4 * 8 + 16 * 8)
    assert work.in_phase(Phase.OPTIMIZER).flops == 0  # SGD's update has no FLOP formula in torch


def test_an_op_moves_its_inputs_and_outputs_and_a_view_moves_nothing() -> None:
    module, batch = mlp()
    work = replayed(module, batch).work
    assert work is not None
    (first,) = [group for group in work.groups if group.op == "addmm" and group.flops == 2 * 32 * 16 * 8]
    # bias (8), the batch (32 x 16), the weight read through its transpose (16 x 8), the output (32 x 8)
    assert first.bytes_moved == FLOAT * (8 + 32 * 16 + 16 * 8 + 32 * 8)
    assert (first.phase, first.dtype, first.count, first.view) == (Phase.FORWARD, "fp32", 1, False)
    views = [group for group in work.groups if group.view]
    assert {group.op for group in views} >= {"t"}
    assert all(group.bytes_moved == 0 for group in views)
    assert work.kernels == work.ops - sum(group.count for group in views)
    assert not any(group.op in ("device", "sym_size", "sym_numel") for group in work.groups)  # metadata: not ops


def test_counting_leaves_every_memory_figure_as_it_was() -> None:
    module, batch = mlp()
    counted = replayed(module, batch)
    plain = replayed(module, batch, count=False)
    assert plain.work is None
    assert counted.phases == plain.phases
    assert counted.modules == plain.modules


def test_checkpointing_marks_the_recomputed_forward() -> None:
    module, batch = mlp()
    plan = CheckpointPlan("network", (("network.0", "network.1"),), None, 0, "network")
    checkpointed = replayed(module, batch, CheckpointChange(plan)).work
    baseline = replayed(module, batch).work
    assert checkpointed is not None
    assert baseline is not None
    recomputed = checkpointed.recomputed()
    print(f"recomputed: {[(group.op, group.flops) for group in recomputed.groups]}")
    assert baseline.recomputed().ops == 0
    assert {group.phase for group in recomputed.groups} == {Phase.BACKWARD}
    assert recomputed.flops == 2 * 32 * 16 * 8  # the first Linear's forward, again
    assert {"addmm", "relu"} <= {group.op for group in recomputed.groups}
    assert checkpointed.flops == baseline.flops + recomputed.flops
