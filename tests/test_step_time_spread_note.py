"""Step-time figures from noisy step times are flagged where they are printed.

A new user's trial printed "costs about +714.7 ms a step ... predicted step 2740.7 ms ... calibrated by this run"
from step times that varied by 108% (a machine loaded by other work) without a word. Where the console summary and
the Markdown report print an advice's step-time figures, a run whose recent step times' interquartile range is above
``lightning-vram diff``'s bound of their median now says its timings are not reliable.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Classifier, ScriptedClock, SlowToLoad, dataset, loader, mlp, trainer

from lightning_vram import VramMonitor
from lightning_vram.measure import setup as machine_setup
from lightning_vram.records import Report
from lightning_vram.render.diff import STEP_TIME_SPREAD_BOUND
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown, summary_text
from lightning_vram.units import format_percent

LOAD_SECONDS = 0.005
"""Each sample's loading time on the scripted clock: 80 ms of data wait per batch of 16."""


class UnevenClassifier(Classifier):
    """A Classifier whose training steps take each of ``seconds`` of the scripted clock in turn."""

    def __init__(self, clock: ScriptedClock, seconds: list[float]) -> None:
        super().__init__(mlp(64, 2))
        self.clock, self.seconds = clock, seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += self.seconds[batch_idx % len(self.seconds)]
        return super().training_step(batch, batch_idx)


@pytest.fixture(autouse=True)
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight CPU cores, whatever this machine has: with one per device the data-wait advice holds back (no spare core
    for a worker)."""
    monkeypatch.setattr(machine_setup, "cpu_cores", lambda: 8)


def data_starved_run(root: Path, work: list[float]) -> Report:
    """14 steps waiting 80 ms for data each, then working each of ``work`` (seconds) in turn: data-wait advice."""
    clock = ScriptedClock()
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=5, console_summary=False, clock=clock)
    data = SlowToLoad(dataset(64, 16 * 14), clock, seconds=LOAD_SECONDS)
    trainer(root, [monitor], max_steps=14).fit(UnevenClassifier(clock, work), loader(data, batch_size=16))
    assert monitor.report is not None
    return monitor.report


def spread_of(steps: list[float]) -> float:
    """The interquartile range of ``steps`` over their median, as the timer computes it."""
    first, _, third = statistics.quantiles(steps, n=4, method="inclusive")
    return (third - first) / statistics.median(steps)


def advice_line(report: Report) -> str:
    """The console summary's line for the data-wait advice (a step-time figure: the time it saves per step)."""
    lines = summary_text(report, width=1000).splitlines()
    (line,) = [line for line in lines if line.startswith("  advice: ") and " ms per step" in line]
    return line


def test_advice_from_noisy_step_times_says_they_are_not_reliable(tmp_path: Path) -> None:
    # Steps of 80 ms waiting plus 20 ms or 200 ms of work, alternately: 100 ms and 280 ms.
    report = data_starved_run(tmp_path, [0.020, 0.200])
    spread = report.timing.step_time_iqr_fraction
    assert spread is not None and spread > STEP_TIME_SPREAD_BOUND
    # 13 steps timed (the first has no batch before it), 7 of 280 ms and 6 of 100 ms: quartiles 100 and 280 ms.
    assert report.summary.timed_steps == 13
    assert spread == pytest.approx(spread_of([0.100] * 6 + [0.280] * 7)) == pytest.approx(0.180 / 0.280)
    note = f"step times varied {format_percent(spread)} (interquartile range over the median): timings not reliable"
    assert "dataloader-workers" in {advice.id for advice in report.advice}
    assert advice_line(report).endswith(f" ms per step; {note})")
    assert f"\n**Timing:** {note}\n" in markdown(report)
    assert markdown(report).count("**Timing:**") == 1  # only the advice with a step-time figure
    assert f"<p><strong>Timing:</strong> {note}</p>" in render_html(report)


def test_advice_from_steady_step_times_has_no_note(tmp_path: Path) -> None:
    # 80 ms waiting plus 20 ms or 35 ms of work: 6 steps of 100 ms, 7 of 115 ms, a spread of 15/115 = 13.0%.
    report = data_starved_run(tmp_path, [0.020, 0.035])
    spread = report.timing.step_time_iqr_fraction
    assert spread == pytest.approx(0.015 / 0.115) and spread < STEP_TIME_SPREAD_BOUND
    assert "dataloader-workers" in {advice.id for advice in report.advice}
    assert advice_line(report).endswith(" ms per step)")
    assert "timings not reliable" not in summary_text(report, width=1000) + markdown(report) + render_html(report)
    assert "**Timing:**" not in markdown(report)
