from typing import Any

import pytest
import torch
from models import Classifier, ScriptedClock, dataset_for, linear_net, loader

from lightning_vram import VramSession
from lightning_vram.measure.timing import StepTimer


def test_wait_counts_only_between_consecutive_batches() -> None:
    # first batch: nothing before it, not counted; 0.5 s wait + 1.0 s work; validation, then a batch not counted
    # (the gap was validation, not data); 3.0 s wait + 1.0 s work
    clock = iter([0.0, 1.0, 1.5, 2.5, 10.0, 11.0, 14.0, 15.0])
    timer = StepTimer(window=8, clock=lambda: next(clock))
    timer.batch_started()
    timer.batch_ended()
    timer.batch_started()
    timer.batch_ended()
    timer.break_continuity()  # validation runs here
    timer.batch_started()
    timer.batch_ended()
    timer.batch_started()
    timer.batch_ended()
    assert timer.median_step_seconds() == 2.75
    assert timer.data_wait_fraction() == 3.5 / 5.5
    assert timer.recent_data_wait_fraction() == 3.5 / 5.5
    interval = timer.take_interval()
    assert interval.step_seconds == 2.75
    assert interval.data_wait_fraction == 3.5 / 5.5
    empty = timer.take_interval()
    assert (empty.step_seconds, empty.data_wait_fraction) == (None, None)


def test_window_is_bounded() -> None:
    now = [0.0]
    timer = StepTimer(window=3, clock=lambda: now[0])
    for work in (1.0, 1.0, 5.0, 5.0, 5.0, 5.0):
        timer.batch_started()
        now[0] += work
        timer.batch_ended()
    assert timer.median_step_seconds() == 5.0  # only the last three steps remain
    assert timer.recent_data_wait_fraction() == 0.0
    assert timer.data_wait_fraction() == 0.0


@pytest.mark.replay
def test_the_replay_of_a_sampled_step_is_neither_step_time_nor_data_wait() -> None:
    clock = ScriptedClock()
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = VramSession(console_summary=False, attribution_start_step=2, attribution_every_n_steps=None, clock=clock)
    session.start(model, [optimizer])
    replay = session._advisor.replay

    def slow_replay(*args: Any) -> None:
        replay(*args)
        clock.now += 100.0  # a replay that takes 100 s of the host clock

    session._advisor.replay = slow_replay  # type: ignore[method-assign]
    for step, batch in enumerate(loader(dataset_for("linear"))):
        if step == 6:
            break
        clock.now += 0.25  # data wait
        session.batch_start(batch)
        loss = model.training_step(batch, step)
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        clock.now += 1.0  # work
        session.batch_end()
    assert session.simulation is not None  # the sampled step was replayed
    summary = session.summary()
    assert summary.step_seconds_median == 1.25
    assert summary.timed_steps == 5  # steps 1 to 5
    assert summary.data_wait_fraction == 0.2
    session.finish()


def test_a_clock_that_returns_no_number_turns_timing_off_saying_so_and_is_not_called_at_construction() -> None:
    # A clock is checked to be callable at construction, not called: a scripted clock would lose a reading.
    calls = []

    def clock() -> str:
        calls.append(1)
        return "x"

    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = VramSession(console_summary=False, replay_budget_seconds=0, preflight=False, clock=clock)  # type: ignore[arg-type]
    assert calls == []
    session.start(model, [optimizer])

    def train(steps: int) -> None:
        for step, batch in enumerate(loader(dataset_for("linear"))):
            if step == steps:
                break
            session.batch_start(batch)
            loss = model.training_step(batch, step)
            session.before_backward()
            loss.backward()
            session.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
            session.batch_end()

    refused = r"step timing failed with TypeError: clock must return seconds as a number, got 'x' \(str\)\. It is off"
    with pytest.warns(UserWarning, match=refused):
        train(3)
    assert len(calls) == 1  # read once, refused: timing is off for the rest of the run, the steps went on
    summary = session.summary()
    assert (summary.timed_steps, summary.step_seconds_median) == (0, None)
    session.finish()
