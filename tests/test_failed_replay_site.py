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


@torch.library.custom_op("lightning_vram_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    """A custom op with no fake kernel: the real step runs it, a replay cannot."""
    return x * 2


doubled.register_autograd(lambda ctx, grad: grad * 2)


class CustomOpInALambda(pl.LightningModule):
    """A custom op with no fake kernel, called from a lambda the module holds as its activation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.activation = lambda x: doubled(x)  # the op's call site

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.activation(self.linear(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_custom_op_without_a_fake_kernel_is_said_to_fail_where_the_user_called_it(tmp_path: Path) -> None:
    """A custom op (``torch.library.custom_op``) goes through torch's ``__call__`` for it on its way to dispatch: the
    site is the user's lambda that called the op, not torch's machinery, and the run is the run without the monitor."""

    def fit(callbacks: list[pl.Callback]) -> CustomOpInALambda:
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator))
        module = CustomOpInALambda()
        trainer(tmp_path, callbacks, max_steps=3).fit(module, loader(data, 8))
        return module

    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    monitored = fit([monitor])
    report = monitor.report
    assert report is not None and report.simulation is not None and report.simulation.skipped is not None
    line = monitored.activation.__code__.co_firstlineno
    # before: "the step failed under fake tensors at torch/_library/custom_ops.py:863 (__call__): ..."
    assert report.simulation.skipped.startswith(
        f"the step failed under fake tensors at {__file__}:{line} (<lambda>): RuntimeError: "
    ), report.simulation.skipped
    plain = fit([])
    assert all(torch.equal(a, b) for a, b in zip(monitored.parameters(), plain.parameters(), strict=True))
