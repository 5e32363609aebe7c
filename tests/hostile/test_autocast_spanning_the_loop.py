"""A plain loop whose ``torch.autocast`` spans the whole loop, the optimizer's step included: training with the session
is bit-identical to training without it.

Autocast's weight cache is the thread's, emptied only when the outermost autocast exits: spanning the optimizer's
updates, the loop keeps training with the first step's casts (stale; torch's documentation advises autocast around
forward only, and users do this). A replay that emptied the cache after running under the user's autocast made the
loop cast afresh and trained another model (an attack: losses apart from step 2 by up to 0.0154, under Fabric's
``fabric.autocast()`` the same).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_vram import VramSession
from lightning_vram.prediction.replay.precision import SPANNING_AUTOCAST_NOTE

pytestmark = pytest.mark.replay  # the replay is what runs under the user's autocast


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for _ in range(5)]


def train(session: VramSession | None) -> tuple[dict[str, torch.Tensor], list[float], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches()
    if session is not None:
        session.start(
            model,
            optimizers=[optimizer],
            dataloader=data,
            precision="bf16-mixed",
            step_function=lambda module, batch: F.cross_entropy(module(batch[0]), batch[1]),
        )
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the whole loop, the optimizer's step included
        for inputs, targets in data:
            if session is not None:
                session.batch_start((inputs, targets))
            loss = F.cross_entropy(model(inputs), targets)
            losses.append(loss.item())
            if session is not None:
                session.before_backward()
            loss.backward()
            if session is not None:
                session.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
            if session is not None:
                session.batch_end()
    report = session.finish() if session is not None else None
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}, losses, report


def test_a_loop_under_one_autocast_trains_the_same_with_the_session(tmp_path: Path) -> None:
    plain_state, plain_losses, _ = train(None)
    session = VramSession(log_dir=tmp_path, attribution_start_step=1, attribution_every_n_steps=None)
    state, losses, report = train(session)
    assert losses == plain_losses
    assert all(torch.equal(plain_state[name], state[name]) for name in plain_state)
    # The replay ran (under the user's autocast, its cache left alone), and says what it could not predict.
    assert report is not None and report.simulation is not None and report.simulation.baseline is not None
    assert SPANNING_AUTOCAST_NOTE in report.simulation.baseline.notes
