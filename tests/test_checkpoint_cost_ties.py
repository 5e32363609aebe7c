"""Checkpointing plans that recompute the same work: the machine's load must not choose between them.

A trial's demo (the quickstart's CNN) advised ``features`` in 2 segments on a loaded machine and in 3 on a quiet one:
both recompute ``features[0:4]``, and their predicted recomputation times, from the host's peaks measured in the run,
were equal but for noise. Here the run's timing is scripted (the pricing monkeypatched: no measured duration is
asserted on), as the trial's two machines gave it, and both must advise the same plan; with the evidence saying
which recomputation figure is which.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from advice_summaries import healthy_setup
from models import trainer
from torch.utils.data import DataLoader

from lightning_vram import Report, VramMonitor
from lightning_vram.advice import budget, time_cost
from lightning_vram.advice.rules import activation_checkpointing as rule
from lightning_vram.records import Advice, CheckpointChange, CheckpointPlan, ReplayedStep
from lightning_vram.render.text import advice_markdown

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from quickstart import SmallCNN, synthetic_images

pytestmark = pytest.mark.replay  # the plans compared are the run's replayed ones

FOUR, TWO, THREE = "4 segments", "2 segments", "3 segments"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """The quickstart's CNN, 3 steps on the CPU, step 2 sampled and its checkpointing plans replayed."""
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    torch.manual_seed(0)
    data = DataLoader(synthetic_images(64 * 3), batch_size=64, shuffle=False)
    trainer(tmp_path_factory.mktemp("demo"), [monitor], max_steps=3).fit(SmallCNN(), data)
    report = monitor.report
    assert report is not None and report.simulation is not None
    return report


def segments(plan: CheckpointPlan) -> str:
    """A sequential plan by its segments (the units its checkpoint_sequential covers)."""
    return f"{plan.sequential_segments} segments"


def scripted(report: Report, milliseconds: dict[str, float]) -> Callable[..., float]:
    """A pricing of each replayed plan's recomputation at the scripted figures, by its segments."""
    assert report.simulation is not None
    by_step = {
        id(variant.replayed): segments(variant.change.plan)
        for variant in report.simulation.variants
        if isinstance(variant.change, CheckpointChange) and variant.replayed is not None
    }

    def price(step: ReplayedStep, *args: object) -> float:
        return milliseconds[by_step[id(step)]] / 1000

    return price


def advised(report: Report, monkeypatch: pytest.MonkeyPatch, milliseconds: dict[str, float]) -> Advice:
    """The checkpointing advice with the plans' recomputation priced at ``milliseconds``."""
    monkeypatch.setattr(time_cost, "recomputation_seconds", scripted(report, milliseconds))
    advice = rule.activation_checkpointing(report.summary, healthy_setup(), report.simulation)
    assert advice is not None
    return advice


# The trial's figures: quiet, 3 segments a hair cheaper; loaded, everything slower and 2 segments a hair cheaper.
QUIET = {FOUR: 15.7, TWO: 10.8 + 1e-9, THREE: 10.8}
LOADED = {FOUR: 41.0, TWO: 28.2, THREE: 28.2 + 1e-9}


def test_plans_recomputing_the_same_work_are_advised_alike_whatever_the_load(
    demo: Report, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert demo.simulation is not None
    plans = {
        segments(variant.change.plan): variant.replayed
        for variant in demo.simulation.variants
        if isinstance(variant.change, CheckpointChange) and variant.replayed is not None
    }
    assert set(plans) == {FOUR, TWO, THREE}
    two, three = plans[TWO], plans[THREE]
    assert two is not None and three is not None
    # The two plans recompute the same work; 3 segments saves more (backward recomputes half as much at a time).
    assert two.work is not None and three.work is not None
    assert two.work.recomputed().flops == three.work.recomputed().flops > 0
    assert two.work.recomputed().bytes_moved == three.work.recomputed().bytes_moved
    assert three.peak.peak_bytes < two.peak.peak_bytes
    quiet, loaded = advised(demo, monkeypatch, QUIET), advised(demo, monkeypatch, LOADED)
    assert quiet.title == loaded.title == "Checkpoint `features` (an nn.Sequential) in 3 segments to free about 5.9 MiB"
    assert "it saves most of the 2 that recompute least (the same recomputed FLOPs and bytes" in loaded.evidence


def test_a_dearer_recomputation_is_still_avoided(demo: Report, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the work differs, the predicted time decides: 4 segments recompute more, and are not advised."""
    advice = advised(demo, monkeypatch, {FOUR: 20.0, TWO: 10.0, THREE: 10.0})
    assert "in 3 segments" in advice.title
    cheap_four = advised(demo, monkeypatch, {FOUR: 5.0, TWO: 10.0, THREE: 10.0})
    assert "in 4 segments" in cheap_four.title, cheap_four.title


def test_the_evidence_and_the_time_cost_say_which_figure_is_which(
    demo: Report, monkeypatch: pytest.MonkeyPatch
) -> None:
    advice = advised(demo, monkeypatch, QUIET)
    monkeypatch.setattr(time_cost, "predicted_step_seconds", lambda *args: 0.0536)
    summary = replace(demo.summary, step_seconds_median=0.0411)
    advice = time_cost.with_time_cost(advice, summary, demo.simulation)
    lines = advice_markdown((advice,)).splitlines()
    evidence = next(line for line in lines if line.startswith("**Evidence:**"))
    assert evidence.endswith(
        "; of 3 replayed plans saving within 2.0% of the peak of the most (5.9 MiB), it saves most of the 2 that"
        " recompute least (the same recomputed FLOPs and bytes, or predicted within 5.0% of the least): its"
        " recomputed ops priced at 10.8 ms, against 15.7 ms for the one saving most (a figure to rank plans by, on"
        f" this CPU ({torch.get_num_threads()} threads), not calibrated: the time cost is the whole step's with the"
        " change, calibrated by this run's measured step time, less that time)"
    ), evidence
    assert "**Time cost:** costs about +12.5 ms a step (+5.5% FLOPs, recomputed forward)" in lines
    assert "**Step time:** predicted step 53.6 ms with the change (roofline, calibrated by this run)" in lines


def fitting(plan: CheckpointPlan, peak: int, seconds: float, work: tuple[int, int]) -> tuple[budget._Tried, Any, int]:
    """A plan the budget search found to fit, its recomputation priced at ``seconds``."""
    return (budget._Tried(plan, True, peak, work[0], peak, seconds, work), None, 4)


def test_the_budget_search_breaks_a_tie_of_the_same_work_by_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """``predict(memory_budget=...)``: of plans that fit and recompute the same work, the lower peak, whatever load."""
    whole = CheckpointPlan("features", (("features.0", "features.1", "features.2", "features.3"),), 2, 1)
    halves = CheckpointPlan("features", (("features.0", "features.1"), ("features.2", "features.3")), 3, 1)
    work = (716_000_000, 64_000_000)
    for two, three in ((0.0108 + 1e-12, 0.0108), (0.0282, 0.0282 + 1e-12)):
        plans = [fitting(whole, 35_000_000, two, work), fitting(halves, 33_700_000, three, work)]
        assert budget._cheapest(plans, True)[0].plan == halves
    dearer = fitting(whole, 30_000_000, 0.030, (900_000_000, 64_000_000))
    assert budget._cheapest([dearer, fitting(halves, 33_700_000, 0.0108, work)], True)[0].plan == halves


def test_a_plan_recomputing_more_is_not_advised_where_the_load_brings_it_within_the_tolerance(
    demo: Report, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 segments recompute more work than 3 and save a little more: priced within 5% of 3 segments on one machine
    and well above on another, the advice is the same (a ResNet's stem with three blocks against the three blocks
    alone, 512 B more saved, was advised or not by the machine's load)."""
    assert demo.simulation is not None
    work = {
        segments(variant.change.plan): variant.replayed.work.recomputed()
        for variant in demo.simulation.variants
        if isinstance(variant.change, CheckpointChange) and variant.replayed is not None and variant.replayed.work
    }
    assert (work[FOUR].flops, work[FOUR].bytes_moved) > (work[THREE].flops, work[THREE].bytes_moved)
    near = advised(demo, monkeypatch, {FOUR: 10.8 * 1.04, TWO: 10.8 + 1e-9, THREE: 10.8})
    far = advised(demo, monkeypatch, QUIET)
    assert near.title == far.title == "Checkpoint `features` (an nn.Sequential) in 3 segments to free about 5.9 MiB"
    assert "it counts the fewest recomputed FLOPs, then bytes moved, of the 3 that recompute least" in near.evidence


def test_the_budget_search_prefers_less_counted_work_to_a_lower_peak_within_the_tolerance() -> None:
    """A plan that fits recomputing more work, priced within 5% of the cheapest by the load, is not chosen for its
    lower peak."""
    whole = CheckpointPlan("features", (("features.0", "features.1", "features.2", "features.3"),), 2, 1)
    halves = CheckpointPlan("features", (("features.0", "features.1"), ("features.2", "features.3")), 3, 1)
    less, more = (716_000_000, 64_000_000), (716_000_000, 68_000_000)
    for dearer_seconds in (0.0108 * 1.04, 0.030):
        plans = [fitting(halves, 33_700_000, 0.0108, less), fitting(whole, 30_000_000, dearer_seconds, more)]
        assert budget._cheapest(plans, True)[0].plan == halves
