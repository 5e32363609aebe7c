"""VramSession's contract with its caller: ``start`` checks its arguments, an unfinished run leaves nothing behind, a
rank gone leaves this rank's report."""

from __future__ import annotations

import gc
import re
import warnings
from typing import Any

import pytest
import torch
from models import Classifier, dataset_for, linear_net, loader

from lightning_vram import VramMonitor, VramMonitorWarning, VramSession
from lightning_vram.records import Phase
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe


def new_session() -> VramSession:
    return VramSession(
        attribution_start_step=0, attribution_every_n_steps=1, console_summary=False, replay_budget_seconds=0
    )


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
    hooks = abandoned._attributor  # its saved-tensor hooks stay on torch's stack: removed after the test
    assert hooks is not None
    del abandoned
    gc.collect()
    try:
        session = new_session()
        session.start(model, [optimizer])
        train(session, model, optimizer, steps=2)
        assert counted_alone(session)
    finally:
        hooks.close()


# ---------------------------------------------------------------------------------------- start's arguments


class NotAWriter:
    """Has none of SummaryWriter's methods."""


START_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"model": None}, TypeError, "model must be a torch.nn.Module, got None"),
    ({"model": "net"}, TypeError, "model must be a torch.nn.Module, got 'net' (str)"),
    ({"default_log_every_n_steps": 0}, ValueError, "default_log_every_n_steps must be >= 1, got 0"),
    ({"default_log_every_n_steps": 2.5}, TypeError, "default_log_every_n_steps must be an int >= 1 or None, got 2.5"),
    (
        {"optimizers": "sgd"},
        TypeError,
        "optimizers must be a list of optimizers or a callable returning them, got 'sgd'",
    ),
    ({"optimizers": ["sgd"]}, TypeError, "optimizers[0] must be an optimizer (with param_groups), got 'sgd' (str)"),
    ({"precision": 16}, TypeError, "precision must be a str such as '32-true' or 'bf16-mixed', got 16 (int)"),
    ({"precision": ""}, ValueError, "precision must be a str such as '32-true' or 'bf16-mixed', got ''"),
    (
        {"device": "cpu:abc"},
        ValueError,
        "device must be a torch.device or a device string such as 'cuda:1', got 'cpu:abc'",
    ),
    ({"device": 0}, TypeError, "device must be a torch.device or a device string such as 'cuda:1', got 0 (int)"),
    ({"setup": 3}, TypeError, "setup must be a callable or None, got 3 (int)"),
    ({"rank": -1}, ValueError, "rank must be >= 0, got -1"),
    ({"rank": True}, TypeError, "rank must be an int >= 0, got True (bool)"),
    ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
    ({"rank": 2, "world_size": 2}, ValueError, "rank must be < world_size (2), got 2"),
    ({"gather": "all"}, TypeError, "gather must be a callable or None, got 'all' (str)"),
    ({"tensorboard": NotAWriter()}, TypeError, "tensorboard must be a list of SummaryWriters, got NotAWriter"),
    (
        {"tensorboard": [NotAWriter()]},
        TypeError,
        "tensorboard[0] must be a SummaryWriter (with add_text, add_custom_scalars, add_image, get_logdir, close),"
        " got NotAWriter",
    ),
    ({"step_function": 3}, TypeError, "step_function must be a callable or None, got 3 (int)"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), START_ERRORS, ids=[str(case[0]) for case in START_ERRORS])
def test_bad_start_arguments_fail_at_start_naming_the_argument(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = Classifier(linear_net())
    call: dict[str, Any] = {"model": model, "optimizers": [torch.optim.SGD(model.parameters(), lr=0.1)], **arguments}
    session = new_session()
    with pytest.raises(error, match=re.escape(message)):
        session.start(call.pop("model"), call.pop("optimizers"), **call)
    assert session.finish() is None  # nothing started


def test_a_device_string_is_a_device() -> None:
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)])
    session = VramSession(probe=probe, console_summary=False, replay_budget_seconds=0)
    session.start(model, [optimizer], device="cuda:1")
    assert probe.opened_with == torch.device("cuda", 1)
    session.close()


def test_a_clock_that_is_not_callable_fails_at_construction() -> None:
    with pytest.raises(TypeError, match=re.escape("clock must be a callable returning seconds, got float")):
        VramSession(clock=1.5)  # type: ignore[arg-type]


def test_a_probe_class_instead_of_a_probe_fails_at_construction() -> None:
    with pytest.raises(TypeError, match=re.escape("probe must be a probe such as ScriptedProbe([...]), got the class")):
        VramMonitor(probe=ScriptedProbe)  # type: ignore[arg-type]


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
