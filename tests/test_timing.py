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
