"""VramSession's contract with its caller: an unfinished run leaves nothing behind; a rank gone leaves this report."""

from __future__ import annotations

import gc
import pickle
import warnings

import torch
from models import Classifier, dataset_for, linear_net, loader
from sessions import new_session, train_steps

from lightning_vram import VramMonitor, VramMonitorWarning, VramSession
from lightning_vram.records import Phase


def train(session: VramSession, model: Classifier, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step, batch in enumerate(loader(dataset_for("linear"))):
        if step == steps:
            return
        session.batch_start(batch)
        loss = model.training_step(batch, step)
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        session.batch_end()


def counted_alone(session: VramSession) -> bool:
    """Whether the session's sampled steps were counted and nothing was blamed on another monitor."""
    report = session.finish()
    assert report is not None
    forward = report.phases.get(Phase.FORWARD)
    blamed = [item for item in report.not_measured if "another monitor" in item.reason]
    return forward is not None and forward.breakdown is not None and forward.breakdown.activations > 0 and not blamed


def test_a_session_started_again_after_an_unfinished_step_blames_no_other_monitor() -> None:
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = new_session()
    session.start(model, [optimizer])
    session.batch_start(None)  # a sampled step, and then the loop died without fail()
    session.start(model, [optimizer])
    train(session, model, optimizer, steps=2)
    assert counted_alone(session)


def test_a_session_after_an_abandoned_one_blames_no_other_monitor() -> None:
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    abandoned = new_session()
    abandoned.start(model, [optimizer])
    abandoned.batch_start(None)  # a sampled step, and then the loop died and dropped its session
    hooks = abandoned._sampler.attributor  # its saved-tensor hooks stay on torch's stack: removed after the test
    assert hooks is not None
    del abandoned
    gc.collect()
    try:
        session = new_session()
        session.start(model, [optimizer])
        train(session, model, optimizer, steps=2)
        assert counted_alone(session)
        assert session.report is not None and session.report.peak is not None
        breakdown = session.report.peak.breakdown  # the abandoned live count was taken off the stack: this one counted
        assert breakdown is not None and breakdown.other is not None
    finally:
        hooks.close()


# ---------------------------------------------------------------------------------------- the other ranks


def gone(values: list[float]) -> list[list[float]]:
    raise RuntimeError("Connection closed by peer")  # what gloo raises when another rank's process has ended


def test_a_failed_exchange_between_ranks_warns_once_and_leaves_this_rank_s_report() -> None:
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = VramSession(log_every_n_steps=1, attribution_start_step=0, console_summary=False, replay_budget_seconds=0)
    barriers: list[int] = []
    session.start(model, [optimizer], rank=0, world_size=2, gather=gone, barrier=lambda: barriers.append(1))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        train(session, model, optimizer, steps=3)
    report = session.finish()
    ours = [str(item.message) for item in warned if issubclass(item.category, VramMonitorWarning)]
    assert len(ours) == 1 and "the exchange between ranks failed with RuntimeError: Connection closed" in ours[0]
    assert report is not None and report.steps == 3
    assert [rank.rank for rank in report.ranks] == [0]
    assert "the exchange between ranks" in [item.what for item in report.not_measured]
    assert barriers == []  # no collective after one failed: the other ranks are gone


def test_every_rank_meets_the_others_once_at_the_end() -> None:
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = VramSession(console_summary=False, replay_budget_seconds=0)
    barriers: list[int] = []
    session.start(
        model,
        [optimizer],
        rank=1,
        world_size=2,
        gather=lambda values: [values, values],
        barrier=lambda: barriers.append(1),
    )
    train(session, model, optimizer, steps=2)
    report = session.finish()
    assert report is not None and [rank.rank for rank in report.ranks] == [0, 1]
    assert barriers == [1]
    assert session.finish() is report and barriers == [1]


def test_a_monitor_and_a_session_pickle_before_and_after_a_run() -> None:
    # ddp_spawn pickles the Trainer's callbacks to start its processes; a closure held by the session would not pickle.
    monitor = VramMonitor(console_summary=False)
    assert isinstance(pickle.loads(pickle.dumps(monitor)), VramMonitor)
    session = new_session()
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session.start(model, [optimizer])
    train_steps(session, model, optimizer, loader(dataset_for("linear")), steps=1)
    session.finish()
    restored = pickle.loads(pickle.dumps(session))
    assert restored.report is not None and restored.report.steps == 1
