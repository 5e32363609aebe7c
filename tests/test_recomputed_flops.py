"""The FLOPs a checkpointing replay counts are the ones torch's checkpoint recomputes for real.

A new user's trial read "+0.0% FLOPs" beside a checkpointing plan that wrapped two convolutions, and expected their
FLOPs (+34%). torch's non-reentrant checkpoint stops recomputing once backward has what it needs
(``set_checkpoint_early_stop``): a convolution saves its inputs before its kernel runs, so one whose output is saved
outside its unit (by the BatchNorm after it) never runs again. The replay runs torch's own checkpoint on fake tensors,
so it counts what the real step recomputes: checked here against ``FlopCounterMode`` over the same step run for real.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import CheckpointChange, CheckpointPlan, ReplayedStep

pytestmark = pytest.mark.replay


def network() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


class Units(nn.Module):
    """``network`` with each of ``units`` (index ranges) run under torch's non-reentrant checkpoint."""

    def __init__(self, net: nn.Sequential, units: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.net, self.units = net, units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = 0
        for start, end in self.units:
            x = self.net[index:start](x)
            x = checkpoint(self.net[start:end], x, use_reentrant=False)
            index = end
        return self.net[index:](x)  # type: ignore[no-any-return]


def loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(module(batch[0]), batch[1])


def real_flops(units: tuple[tuple[int, int], ...], batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """FLOPs of one forward and backward, run for real with ``units`` checkpointed."""
    torch.manual_seed(0)
    module = Units(network(), units)
    with FlopCounterMode(display=False) as counter:
        loss(module, batch).backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize(
    ("units", "recomputes_a_convolution"),
    [(((3, 4),), False), (((3, 5),), True), (((1, 4),), False), (((1, 3), (3, 4)), False)],
    ids=["conv alone", "conv and the BatchNorm saving its output", "BatchNorm, SiLU and a last conv", "trial's split"],
)
def test_the_replay_counts_the_flops_torch_recomputes(
    units: tuple[tuple[int, int], ...], recomputes_a_convolution: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 3, 16, 16, generator=generator), torch.randint(0, 10, (16,), generator=generator))
    torch.manual_seed(0)
    module = network()
    predictor = Predictor(module, [], batch, step_function=loss, placement=torch.device("cpu"))
    baseline = predictor.replay(None, count_flops=True)
    plan = CheckpointPlan("", tuple(tuple(str(i) for i in range(start, end)) for start, end in units), None, 0, None)
    variant = predictor.replay(CheckpointChange(plan), count_flops=True)
    assert isinstance(baseline, ReplayedStep) and isinstance(variant, ReplayedStep)
    assert baseline.flops == real_flops((), batch)
    assert variant.flops == real_flops(units, batch)
    assert (variant.flops > baseline.flops) is recomputes_a_convolution
