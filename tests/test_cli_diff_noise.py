"""``lightning-vram diff`` with noisy step times: the ratio of medians comes with how much each run's step times
varied, and is called not reliable where either run's interquartile range is above 25% of its median.

A new user's trial printed a 13x step-time ratio between two runs, one of them timed on a machine loaded by other
work, as if it meant something. The timer now records its window's spread (``timing.step_time_iqr_fraction``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from advice_summaries import healthy_summary

from lightning_vram.cli import main
from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.measure.timing import StepTimer
from lightning_vram.records import Report

MEASURE = "step times vary (interquartile range over the median)"


class Clock:
    """A host clock moved by hand, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(steps: list[float]) -> StepTimer:
    """A timer that saw one batch, then one of each of ``steps`` (seconds of work, no data wait)."""
    clock = Clock()
    timer = StepTimer(window=50, clock=clock)
    timer.batch_started()
    timer.batch_ended()
    for seconds in steps:
        timer.batch_started()
        clock.now += seconds
        timer.batch_ended()
    return timer


def test_the_timer_gives_its_window_s_interquartile_range_over_the_median() -> None:
    # Quartiles (inclusive) of 0.1, 0.1, 0.1, 0.1, 0.3 are 0.1 and 0.1: one slow step is no spread.
    assert timed([0.1, 0.1, 0.1, 0.1, 0.3]).step_time_iqr_fraction() == pytest.approx(0.0, abs=1e-12)
    # 0.1, 0.2, 0.3, 0.4, 0.5: quartiles 0.2 and 0.4, median 0.3.
    spread = timed([0.1, 0.2, 0.3, 0.4, 0.5]).step_time_iqr_fraction()
    assert spread == pytest.approx(0.2 / 0.3)
    assert timed([0.1, 0.2, 0.3]).step_time_iqr_fraction() is None  # under four steps: no quartiles


def report(median: float, spread: float | None) -> Report:
    """A report whose steps took ``median`` seconds, varying by ``spread`` (its JSON form read back)."""
    summary = healthy_summary(step_seconds_median=median, step_time_iqr_fraction=spread)
    written = report_to_dict(Report(summary=summary, precision="32-true", modules=(), advice=(), fit=(), ranks=()))
    assert written["timing"]["step_time_iqr_fraction"] == spread
    read = report_from_dict(json.loads(json.dumps(written)))
    assert read.timing.step_time_iqr_fraction == spread
    return read


def step_time_line(before: Report, after: Report, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``lightning-vram diff A B``'s step-time line."""
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, data in zip(paths, (before, after), strict=True):
        path.write_text(json.dumps(report_to_dict(data)))
    assert main(["diff", *map(str, paths)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  step time (median): ")]
    return line


def test_a_ratio_from_a_noisy_run_is_said_to_be_unreliable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = step_time_line(report(0.1, 0.04), report(1.3, 0.9), tmp_path, capsys)
    assert line == (
        f"  step time (median): 100.0 ms -> 1300.0 ms (13.00x); {MEASURE} 4.0% in A, 90.0% in B: not reliable, over"
        " 25.0%"
        " in B (a machine loaded by other work times steps unevenly; measure again on a quiet one)"
    )


def test_a_ratio_from_quiet_runs_comes_with_their_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = step_time_line(report(0.2, 0.05), report(0.1, 0.25), tmp_path, capsys)
    assert line == (
        f"  step time (median): 200.0 ms -> 100.0 ms (0.50x); {MEASURE} 5.0% in A, 25.0% in B: within 25.0%, steady"
        " within each run (a load that changed between the runs is not seen here)"
    )
    # An older report records no spread: the ratio is still never bare.
    line = step_time_line(report(0.2, None), report(0.1, 0.05), tmp_path, capsys)
    assert line.endswith(f"(0.50x); {MEASURE} not recorded in A, 5.0% in B: reliability unknown")
