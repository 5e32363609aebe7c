"""VramSession runs without a Trainer: a session counting every step, and a plain loop that writes report files."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from models import Classifier, dataset_for, loader
from torch import nn

from lightning_vram import VramSession


def new_session() -> VramSession:
    return VramSession(
        attribution_start_step=0, attribution_every_n_steps=1, console_summary=False, replay_budget_seconds=0
    )


def plain_run(log_dir: str | Path | None, network: nn.Module | None = None, steps: int = 3) -> VramSession:
    """A few steps of a small MLP through VramSession, without a Trainer."""
    torch.manual_seed(0)
    module = Classifier(network or nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)))
    optimizer = module.configure_optimizers()
    data = loader(dataset_for("linear"))
    session = VramSession(log_dir=log_dir, attribution_start_step=1, attribution_every_n_steps=1, console_summary=False)
    session.start(module, optimizers=[optimizer], dataloader=data)
    train_steps(session, module, optimizer, data, steps)
    session.finish()
    return session


def train_steps(
    session: VramSession, module: Classifier, optimizer: torch.optim.Optimizer, data: Iterable[Any], steps: int
) -> None:
    """Lightning's automatic optimization written out, ``steps`` batches: forward, zero_grad, backward, step.

    As Lightning's closure does, a detached copy of the loss is kept through the step (a live tensor the CPU's live
    peaks see).
    """
    for step, batch in enumerate(data):
        if step == steps:
            break
        session.batch_start(batch)
        loss = module.training_step(batch, step)
        kept = loss.detach().clone()  # noqa: F841 -- alive through the step, as Lightning's ClosureResult.loss
        optimizer.zero_grad()
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        session.batch_end()


FILES = ("vram_report.json", "vram_report.md", "vram_report.html")
