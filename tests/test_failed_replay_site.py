"""A replay that fails under fake tensors says where: the op's call site, as a value read does.

A new user's trial (session 15) trained a ``transformers`` Mixtral (``MixtralConfig``, random weights, fp32 on the
CPU) and was told only "the step failed under fake tensors: RuntimeError: Expected inputs of BF16 type but got
mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32.", which reads as a dtype bug in the model: the real step
ran, while torch's fake-tensor version of ``grouped_mm`` (the experts' grouped matmul) takes bfloat16 alone. The
reason now names the call, ``torch/nn/functional.py:... (grouped_mm)``. The model here calls the same op in fp32, as
transformers' experts do on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from models import loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.prediction.replay.skips import skip_reason

pytestmark = pytest.mark.replay

GROUPED_MM = getattr(F, "grouped_mm", None)


class GroupedExperts(pl.LightningModule):
    """Two experts' weights in one tensor, applied to fixed groups of rows by one grouped matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, 16, 16) * 0.1)
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        assert GROUPED_MM is not None
        return F.cross_entropy(self.head(GROUPED_MM(x, self.experts, offs=offsets)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.skipif(GROUPED_MM is None, reason="torch.nn.functional.grouped_mm arrived in torch 2.10")
def test_a_replay_failing_in_an_op_names_where_the_op_was_called(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator))
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=2).fit(GroupedExperts(), loader(data, 8))  # the real step runs fp32
    report = monitor.report
    assert report is not None and report.simulation is not None
    skipped = report.simulation.skipped
    assert skipped is not None
    # before: "the step failed under fake tensors: RuntimeError: Expected inputs of BF16 type ..." and no site
    assert skipped.startswith("the step failed under fake tensors at torch/nn/functional.py:"), skipped
    assert "(grouped_mm): RuntimeError: " in skipped, skipped


def test_a_failure_without_a_frame_outside_the_replay_keeps_the_plain_reason() -> None:
    assert skip_reason(RuntimeError("boom")) == "the step failed under fake tensors: RuntimeError: boom"
