"""Checkpointing advice written for the loop that trains the model, applied exactly as printed in each.

A plain loop measured by ``VramSession`` (a user's module of conv blocks), Fabric on the CPU and a plain loop (each
training the root ``nn.Sequential`` CNN with BatchNorm of examples/fabric_loop.py), and a LightningModule under a
Trainer: each run with the monitor, the advice's code block executed as it is printed with the model named as the
advice names it (``model`` in a loop, ``self`` in a LightningModule), the run repeated: the saving the replay
predicted shows (within 1%), the advice is gone, and training with the change gives the same losses, parameters,
buffers (BatchNorm statistics, ``num_batches_tracked``) and RNG state as without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from advice_models import images
from lightning.fabric import Fabric
from models import Classifier, loader, trainer
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor, VramSession
from lightning_vram.advice.checkpoint_code import CodeContext, checkpoint_snippet
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.records import TrainingLoop

pytestmark = pytest.mark.replay  # the advice and its saving come from the replay

BATCH = 32


def conv_block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU())


class Blocks(nn.Module):
    """A user's module: a stem, a ModuleList of conv-BN-ReLU blocks with Dropout between, a pooled linear head."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(conv_block(width, width) for _ in range(depth))
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.stem(inputs)
        for block in self.blocks:
            x = self.dropout(block(x))
        return self.head(x.mean(dim=(2, 3)))  # type: ignore[no-any-return]


def sequential_cnn() -> nn.Sequential:
    """examples/fabric_loop.py's model: conv-BN-ReLU(inplace) twice, global pooling, Flatten, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 32, kernel_size=3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


# ------------------------------------------------------------------------------------------------------ the loops


@dataclass(frozen=True)
class Trained:
    losses: list[float]
    state: list[torch.Tensor]
    rng: torch.Tensor


def loop(
    network: nn.Module, data: TensorDataset, steps: int, fabric: bool, session: VramSession | None = None
) -> Trained:
    """``steps`` Adam steps of ``network`` in a plain loop, or through Fabric on the CPU; measured by ``session``."""
    torch.manual_seed(0)
    optimizer: Any = torch.optim.Adam(network.parameters(), lr=1e-3)
    model: Any = network
    batches: Any = loader(data, BATCH)
    runner = Fabric(accelerator="cpu", devices=1) if fabric else None
    if runner is not None:
        model, optimizer = runner.setup(network, optimizer)
        batches = runner.setup_dataloaders(batches)
    if session is not None:
        session.start(network, optimizers=[optimizer], dataloader=batches, step_function=loss_of)
    losses = []
    for step, batch in zip(range(steps), batches, strict=False):
        if session is not None:
            session.batch_start(batch)
        loss = loss_of(model, batch)
        if session is not None:
            session.before_backward()
        if runner is not None:
            runner.backward(loss)
        else:
            loss.backward()  # type: ignore[no-untyped-call]
        if session is not None:
            session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        if session is not None:
            session.batch_end()
        losses.append(loss.item())
        del step
    # Parameters and buffers in the order modules were built: wrapping renames the keys, not the order.
    return Trained(losses, [tensor.detach().clone() for tensor in network.state_dict().values()], torch.get_rng_state())


def session_report(network: nn.Module, data: TensorDataset, fabric: bool) -> Report:
    session = VramSession(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    loop(network, data, 3, fabric, session)
    report = session.finish()
    assert report is not None
    return report


def lightning_report(tmp_path: Path, network: nn.Module, data: TensorDataset) -> Report:
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    torch.manual_seed(0)
    trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(network, torch.optim.Adam), loader(data, BATCH))
    assert monitor.report is not None
    return monitor.report


def printed(report: Report) -> tuple[int, str]:
    """The checkpointing advice's saving and its code block."""
    advice = next(advice for advice in report.advice if advice.id == "activation-checkpointing")
    assert advice.saving_basis == "simulated" and advice.estimated_saving_bytes is not None
    (code,) = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    return advice.estimated_saving_bytes, code


def applied(make: Callable[[], nn.Module], code: str, name: str) -> nn.Module:
    """A fresh model from seed 1 with ``code`` run on it as printed, the model named ``name`` (``model``/``self``)."""
    torch.manual_seed(1)
    network = make()
    namespace: dict[str, Any] = {name: network}
    exec(code, namespace)
    result = namespace[name]
    assert isinstance(result, nn.Module)
    return result


def fresh(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(1)
    return make()


def assert_same(plain: Trained, changed: Trained) -> None:
    assert plain.losses == changed.losses
    assert len(plain.state) == len(changed.state)
    assert [index for index, (a, b) in enumerate(zip(plain.state, changed.state, strict=True)) if not a.equal(b)] == []
    assert torch.equal(plain.rng, changed.rng)


def assert_realised(before: Report, after: Report, saving: int) -> None:
    assert before.peak is not None and after.peak is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(saving, rel=0.01)
    assert [advice.id for advice in after.advice if advice.id == "activation-checkpointing"] == []


# ------------------------------------------------------------------------------------------------------ the contexts

LOOPS: dict[str, tuple[Callable[[], nn.Module], bool, str]] = {
    "plain loop": (Blocks, False, "model.blocks[index] = Checkpointed(model.blocks[index])"),
    # The max pooling's unit alone frees at the peak what the best modelled plan (the units from 1 to 6) frees.
    "plain loop, nn.Sequential": (sequential_cnn, False, "\nmodel[3] = Checkpointed(model[3])"),
    "fabric, nn.Sequential": (sequential_cnn, True, "before `fabric.setup(model, optimizer)`"),
}


@pytest.mark.parametrize("case", sorted(LOOPS))
def test_session_advice_applied_as_printed_realises_and_trains_the_same(case: str) -> None:
    make, fabric, expected = LOOPS[case]
    data = images(BATCH * 6, size=32)
    report = session_report(fresh(make), data, fabric)
    saving, code = printed(report)
    assert expected in code and "self" not in code.rpartition("\n\n")[2]
    assert "LightningModule" not in code
    plain = loop(fresh(make), data, 6, fabric)
    assert_same(plain, loop(applied(make, code, "model"), data, 6, fabric))
    if make is sequential_cnn:
        # The best modelled plan's code, its units of several modules in place: Flatten and the global pooling save
        # nothing, never a unit of their own. It trains the same model too.
        context = CodeContext(TrainingLoop.FABRIC if fabric else TrainingLoop.PLAIN, "Sequential")
        best = checkpoint_snippet(checkpoint_candidates(report.summary.modules)[0], context)[1]
        assert "((1, 3), (3, 4), (4, 5), (5, 7))" in best and "model[start] = Checkpointed(*model[start:end])" in best
        assert_same(plain, loop(applied(make, best, "model"), data, 6, fabric))
    # Measured against the run that printed the advice (a second run of it measured the same peak and advice).
    assert_realised(report, session_report(applied(make, code, "model"), data, fabric), saving)


def test_lightning_advice_applied_as_printed_realises_and_trains_the_same(tmp_path: Path) -> None:
    data = images(BATCH * 6, size=32)

    def make() -> nn.Module:
        return Classifier(Blocks(), torch.optim.Adam)

    before = lightning_report(tmp_path, Blocks(), data)
    saving, code = printed(before)
    assert "# in the LightningModule's __init__" in code
    assert "self.network.blocks[index] = Checkpointed(self.network.blocks[index])" in code
    assert_same(loop(fresh(make), data, 6, False), loop(applied(make, code, "self"), data, 6, False))
    torch.manual_seed(1)
    module = applied(make, code, "self")
    assert isinstance(module, Classifier)
    assert_realised(before, lightning_report(tmp_path, module.network, data), saving)
