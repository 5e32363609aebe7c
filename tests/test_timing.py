from lightning_vram.measure.timing import StepTimer


def test_wait_counts_only_between_consecutive_batches() -> None:
    timer = StepTimer(window=8)
    timer.batch_started(0.0)
    timer.batch_ended(1.0)  # first batch: nothing before it, not counted
    timer.batch_started(1.5)
    timer.batch_ended(2.5)  # 0.5 s wait + 1.0 s work
    timer.break_continuity()  # validation runs here
    timer.batch_started(10.0)
    timer.batch_ended(11.0)  # not counted: the gap was validation, not data
    timer.batch_started(14.0)
    timer.batch_ended(15.0)  # 3.0 s wait + 1.0 s work
    assert timer.median_step_seconds() == 2.75
    assert timer.data_wait_fraction() == 3.5 / 5.5
    assert timer.recent_data_wait_fraction() == 3.5 / 5.5
    interval = timer.take_interval()
    assert interval.step_seconds == 2.75
    assert interval.data_wait_fraction == 3.5 / 5.5
    empty = timer.take_interval()
    assert (empty.step_seconds, empty.data_wait_fraction) == (None, None)


def test_window_is_bounded() -> None:
    timer = StepTimer(window=3)
    now = 0.0
    for work in (1.0, 1.0, 5.0, 5.0, 5.0, 5.0):
        timer.batch_started(now)
        now += work
        timer.batch_ended(now)
    assert timer.median_step_seconds() == 5.0  # only the last three steps remain
    assert timer.recent_data_wait_fraction() == 0.0
    assert timer.data_wait_fraction() == 0.0
