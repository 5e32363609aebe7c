"""The stale-gradients advice in a plain or Fabric loop says what to change in the loop, not in a Trainer.

A trial's Fabric loop that zeroed the gradients after the forward pass (as Lightning's automatic optimization does)
was advised a ``Callback`` for ``Trainer(callbacks=[FreeGradientsBeforeForward(), VramMonitor()])``: there is no
Trainer in such a loop. The advice now gives the loop's own line: ``optimizer.zero_grad(set_to_none=True)`` at batch
start, before the forward pass. Applied as printed, the gradients are gone from the forward pass, the peak falls by
the promised saving, the advice is gone, and the model trains bit for bit as before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier, loader
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramSession
from lightning_vram.records import Phase

WIDTH, DEPTH, BATCH, STEPS = 512, 2, 64, 4


def _mlp() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def _train(monitored: bool, free_first: bool) -> tuple[Report | None, dict[str, Any]]:
    """SGD on an MLP in a plain loop (its optimizer step holds no state: the live peak is in forward while the last
    step's gradients are alive). ``free_first``: the advice applied, the gradients set to None at batch start;
    else zeroed after the forward pass, as Lightning does. The report, and the trained weights and losses."""
    torch.manual_seed(0)
    module = Classifier(_mlp(), OPTIMIZERS["sgd"])
    optimizer = module.configure_optimizers()
    generator = torch.Generator().manual_seed(0)
    data = loader(
        TensorDataset(torch.randn(STEPS * BATCH, WIDTH, generator=generator), torch.randint(0, 10, (STEPS * BATCH,))),
        BATCH,
    )
    session = VramSession(attribution_start_step=2, attribution_every_n_steps=5, console_summary=False)
    if monitored:
        session.start(module, optimizers=[optimizer], dataloader=data)
    losses = []
    for step, batch in enumerate(data):
        if monitored:
            session.batch_start(batch)
        if free_first:  # the advice's lines (no accumulation: every step)
            optimizer.zero_grad(set_to_none=True)
        loss = module.training_step(batch, step)
        if not free_first:
            optimizer.zero_grad()
        if monitored:
            session.before_backward()
        loss.backward()
        if monitored:
            session.before_optimizer_step()
        optimizer.step()
        if monitored:
            session.batch_end()
        losses.append(loss.detach())
    report = session.finish() if monitored else None
    return report, {"state": module.state_dict(), "losses": losses, "rng": torch.get_rng_state()}


def _same(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return (
        all(torch.equal(first["state"][name], second["state"][name]) for name in first["state"])
        and all(torch.equal(a, b) for a, b in zip(first["losses"], second["losses"], strict=True))
        and torch.equal(first["rng"], second["rng"])
    )


def test_the_advice_in_a_loop_is_a_line_of_the_loop_and_applied_as_printed_saves_what_it_said() -> None:
    before, trained = _train(monitored=True, free_first=False)
    assert before is not None and before.peak is not None
    [advice] = [item for item in before.advice if item.id == "stale-gradients"]
    # Before: "... in a Callback listed before VramMonitor ... trainer = Trainer(callbacks=[...])".
    assert "Callback" not in advice.detail and "Trainer(" not in advice.detail, advice.detail
    assert "session.batch_start(batch)" in advice.detail
    assert "optimizer.zero_grad(set_to_none=True)  # here, before the forward pass" in advice.detail
    assert advice.estimated_saving_bytes is not None and advice.estimated_saving_bytes > 0

    after, applied = _train(monitored=True, free_first=True)
    assert after is not None and after.peak is not None
    assert "stale-gradients" not in {item.id for item in after.advice}
    forward = after.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.gradients == 0
    assert before.peak.peak_bytes - after.peak.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    # The same model, bit for bit: with and without the advice, with and without the monitor.
    assert _same(trained, applied)
    assert _same(trained, _train(monitored=False, free_first=False)[1])
    assert _same(applied, _train(monitored=False, free_first=True)[1])
