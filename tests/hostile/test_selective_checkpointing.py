"""The user's own selective checkpointing (torch's ``create_selective_checkpoint_contexts``) on sampled steps.

The monitor reads the outputs selective checkpointing keeps from forward out of torch's dispatch mode, to count them
as activations: a ResNet-style block under the user's own policy (convolutions kept, a call counter of the user's)
trains with and without the monitor, every step sampled, compared exactly, the policy's calls included; the report
counts the two kept convolution outputs as the block's activations and names the unit re-run selectively.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import FLOAT32, Classifier, loader
from test_selective_kept import Residual
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.data import TensorDataset

CALLS = {"policy": 0}
"""How often the user's policy was asked, in forward and in the recomputation."""
CHANNELS, SIDE, BATCH = 8, 8, 8


def keep_convolutions(_context: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    """The user's policy: keep every convolution's output, recompute the rest; counts its calls."""
    CALLS["policy"] += 1
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.convolution.default else CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    """``block`` under torch's selective checkpointing with the user's policy."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        contexts = functools.partial(create_selective_checkpoint_contexts, keep_convolutions)
        return checkpoint(self.block, inputs, use_reentrant=False, context_fn=contexts)  # type: ignore[no-any-return]


def build() -> Case:
    CALLS["policy"] = 0
    network = nn.Sequential(
        nn.Conv2d(3, CHANNELS, 3, padding=1, bias=False),
        Selective(Residual(CHANNELS)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(CHANNELS, 4),
    )
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4 * BATCH, 3, SIDE, SIDE, generator=generator),
        torch.randint(0, 4, (4 * BATCH,), generator=generator),
    )
    return Case(Classifier(network), loader(data, BATCH), observe=lambda: dict(CALLS))


@pytest.mark.parametrize("path", PATHS)
def test_the_users_selective_checkpointing_trains_as_without_the_monitor_its_kept_outputs_counted(
    tmp_path: Path, path: str
) -> None:
    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    assert CALLS["policy"] > 0  # the policy decided in forward and in the recomputation
    report = monitor.report
    assert report is not None
    assert report.recomputed_units == (("network.1.block",),)
    assert report.selective_units == ("network.1.block",)
    saved = {row.name: row.activation_bytes for row in report.modules}
    assert saved["network.1.block"] == 2 * BATCH * CHANNELS * SIDE * SIDE * FLOAT32  # its two convolutions' outputs
