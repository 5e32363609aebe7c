"""Plain PyTorch loops with a ``VramSession``: a run with it trains exactly as one without it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import equal
from models import cnn_net, dataset_for, loader
from torch import nn

from lightning_vram import VramSession
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

StepFunction = Callable[[nn.Module, Any], torch.Tensor]


def train(root: Path, session: VramSession | None, step_function: Callable[[nn.Module], StepFunction]) -> Any:
    torch.manual_seed(0)
    model = cnn_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    if session is not None:
        session.start(model, optimizers=[optimizer], step_function=step_function(model))
    for inputs, targets in loader(dataset_for("cnn"), batch_size=8):
        if session is not None:
            session.batch_start((inputs, targets))
        loss = nn.functional.cross_entropy(model(inputs), targets)
        losses.append(loss.detach())
        if session is not None:
            session.before_backward()
        loss.backward()  # type: ignore[no-untyped-call]
        if session is not None:
            session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        grads_after_zero_grad = [parameter.grad for parameter in model.parameters()]
        if session is not None:
            session.batch_end()
    if session is not None:
        session.finish()
    return model.state_dict(), optimizer.state_dict(), losses, grads_after_zero_grad


def closes_over_the_real_model(model: nn.Module) -> StepFunction:
    return lambda _module, batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


def calls_the_module_it_is_given(_model: nn.Module) -> StepFunction:
    return lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1])


@pytest.mark.parametrize("probe", [None, "scripted cuda"])
def test_a_step_function_that_reaches_the_real_model_is_not_replayed_and_the_report_says_why(
    tmp_path: Path, probe: str | None
) -> None:
    bare = train(tmp_path, None, closes_over_the_real_model)
    options: dict[str, Any] = {"attribution_start_step": 1, "console_summary": False, "log_dir": tmp_path / "run"}
    if probe is not None:
        options["probe"] = ScriptedProbe([ScriptedBoundary(0, 0, 0)])
    session = VramSession(**options)
    watched = train(tmp_path, session, closes_over_the_real_model)
    assert equal(bare, watched)  # BatchNorm's counters, weights, momentum, losses; no .grad after zero_grad
    simulation = session.simulation
    assert simulation is not None and simulation.baseline is None
    assert simulation.skipped is not None and "reaches the trained model itself" in simulation.skipped
    assert "step_function" in simulation.skipped


def test_a_step_function_that_calls_the_module_it_is_given_is_replayed(tmp_path: Path) -> None:
    bare = train(tmp_path, None, calls_the_module_it_is_given)
    session = VramSession(attribution_start_step=1, console_summary=False, log_dir=tmp_path / "run")
    watched = train(tmp_path, session, calls_the_module_it_is_given)
    assert equal(bare, watched)
    simulation = session.simulation
    assert simulation is not None and simulation.skipped is None and simulation.baseline is not None
