"""The inplace-activations advice names the modules it makes inplace, in code that changes only those.

A new user's trial (the fourteenth session) was advised "Use inplace activations (e.g. `ELU(inplace=True)`) in 2
module(s)" for a CNN with three ELUs, with the code ``nn.ELU(inplace=True)  # its other arguments as they were``:
which two, the code did not say. Where an activation is left out because an earlier op saved its input (the evidence
says so, in words), making every activation of that class inplace, as the code reads, breaks backward. The code now
sets ``inplace = True`` on each module the advice names, and only on those.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from advice_models import features
from models import OPTIMIZERS, Classifier, loader, trainer
from torch import nn

from lightning_vram import Report, VramMonitor, VramSession
from lightning_vram.records import Advice, AdviceId

WIDTH = 256


class GatedMLP(nn.Module):
    """Two LeakyReLUs: ``act1`` after a Linear (safe inplace), ``act2`` after a sigmoid, which saved its output for
    backward (inplace would overwrite it: left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.act1 = nn.LeakyReLU()
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.act2 = nn.LeakyReLU()
        self.fc3 = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = torch.sigmoid(self.fc2(self.act1(self.fc1(x))))
        out: torch.Tensor = self.fc3(self.act2(gated))
        return out


def _run(root: Path, module: Classifier) -> Report:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(features(1024, WIDTH), 512))
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report


def _code(advice: Advice) -> str:
    (code,) = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    return code


@pytest.mark.replay  # the advice's saving is replayed
def test_the_printed_code_makes_only_the_named_modules_inplace(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = Classifier(GatedMLP(), OPTIMIZERS["adam"])
    before = _run(tmp_path / "before", plain)
    advice = next((item for item in before.advice if item.id is AdviceId.INPLACE_ACTIVATIONS), None)
    assert advice is not None, [item.id for item in before.advice]
    assert "left out because autograd saved their input for an earlier op: network.act2" in advice.evidence
    code = _code(advice)
    # Before: 'nn.LeakyReLU(inplace=True)  # its other arguments as they were', both LeakyReLUs by their class.
    assert [line for line in code.splitlines() if not line.startswith("#")] == ["self.network.act1.inplace = True"]
    torch.manual_seed(0)
    applied = Classifier(GatedMLP(), OPTIMIZERS["adam"])
    exec(code, {"self": applied})  # in the LightningModule's __init__, as the code's comment says
    after = _run(tmp_path / "after", applied)
    assert before.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    # LeakyReLU's inplace gradient is the same arithmetic: the same model, bit for bit.
    for (name, trained), (_, again) in zip(plain.state_dict().items(), applied.state_dict().items(), strict=True):
        assert torch.equal(trained, again), name


class KeyedBlocks(nn.Module):
    """Two blocks held by an ``nn.ModuleDict`` under the keys ``"0"`` and ``"1"``, each a Linear and a LeakyReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({key: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LeakyReLU()) for key in "01"})
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for key in "01":
            x = self.blocks[key](x)
        out: torch.Tensor = self.head(x)
        return out


def _plain_run(root: Path, model: nn.Module) -> Report:
    torch.manual_seed(1)
    batches = [(torch.randn(512, WIDTH), torch.randint(0, 10, (512,))) for _ in range(3)]
    optimizer = torch.optim.Adam(model.parameters())
    session = VramSession(log_dir=root, attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    session.start(
        model,
        optimizers=[optimizer],
        dataloader=batches,
        step_function=lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1]),
    )
    for batch in batches:
        session.batch_start(batch)
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        session.batch_end()
    return session.finish()


@pytest.mark.replay  # the advice's saving is replayed
def test_a_module_dicts_children_are_reached_by_their_key(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = KeyedBlocks()
    before = _plain_run(tmp_path / "before", plain)
    advice = next((item for item in before.advice if item.id is AdviceId.INPLACE_ACTIVATIONS), None)
    assert advice is not None, [item.id for item in before.advice]
    code = _code(advice)
    # Before: 'model.blocks[0][1].inplace = True', which raised KeyError: 0 (a ModuleDict's keys are strings).
    assert [line for line in code.splitlines() if not line.startswith("#")] == [
        "model.blocks['0'][1].inplace = True",
        "model.blocks['1'][1].inplace = True",
    ]
    torch.manual_seed(0)
    applied = KeyedBlocks()
    exec(code, {"model": applied})  # after building the model, as the code's comment says
    after = _plain_run(tmp_path / "after", applied)
    assert before.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    assert not any(item.id is AdviceId.INPLACE_ACTIVATIONS for item in after.advice)
    for (name, trained), (_, again) in zip(plain.state_dict().items(), applied.state_dict().items(), strict=True):
        assert torch.equal(trained, again), name


@pytest.mark.replay  # the advice's saving is replayed
def test_a_module_dicts_child_is_checkpointed_by_its_key(tmp_path: Path) -> None:
    """The checkpointing lines reach a ModuleDict's children by key too (they share the inplace lines' paths)."""
    torch.manual_seed(0)
    plain = KeyedBlocks()
    before = _plain_run(tmp_path / "before", plain)
    advice = next((item for item in before.advice if item.id is AdviceId.ACTIVATION_CHECKPOINTING), None)
    assert advice is not None, [item.id for item in before.advice]
    code = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)[-1]
    # Before: 'model.blocks[0] = Checkpointed(model.blocks[0])', which raised KeyError: 0.
    assert "model.blocks['0'] = Checkpointed(model.blocks['0'])" in code.splitlines()
    torch.manual_seed(0)
    applied = KeyedBlocks()
    exec(code, {"model": applied})  # after building the model, as the code's comment says
    after = _plain_run(tmp_path / "after", applied)
    assert before.peak is not None and after.peak is not None and advice.estimated_saving_bytes is not None
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    for (name, trained), again in zip(plain.state_dict().items(), applied.state_dict().values(), strict=True):
        assert torch.equal(trained, again), name  # the keys gain '.block', as the code's comment says
