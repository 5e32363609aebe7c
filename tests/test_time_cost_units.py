"""An advice's step-time cost from hand-built replays: each kind of change, the JSON form, the views, the diff line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from advice_summaries import healthy_summary
from simulations import BASELINE, GIB, replayed, simulated

from lightning_vram.advice.time_cost import with_time_cost
from lightning_vram.cli import load_report
from lightning_vram.codec import FormatError
from lightning_vram.records import (
    Advice,
    AdviceId,
    BatchSizeChange,
    CheckpointChange,
    CheckpointPlan,
    CostBasis,
    FreeGradientsChange,
    InplaceChange,
    LengthChange,
    PrecisionChange,
    Report,
    SavingBasis,
    Severity,
    StepChange,
    TokensPerBatchChange,
)
from lightning_vram.records.advice_json import advice_from_dict, advice_to_dict
from lightning_vram.render.diff import time_line
from lightning_vram.render.html import _advice_html
from lightning_vram.render.text import advice_markdown, advice_summary

PLAN = CheckpointPlan("network", (("0",), ("1",)), None, GIB)
FLOPS = 1_000_000
PREDICTED = 6 * GIB
"""The advice's predicted peak: the variant replayed with its change peaks here."""


def advice(advice_id: AdviceId = AdviceId.ACTIVATION_CHECKPOINTING, **fields: object) -> Advice:
    given: dict[str, object] = {"saving_basis": SavingBasis.SIMULATED, "predicted_peak_bytes": PREDICTED, **fields}
    return Advice(advice_id, Severity.INFO, "Do it", "detail", "evidence", 2 * GIB, **given)  # type: ignore[arg-type]


def priced(change: StepChange, flops: int, step_seconds: float | None = 0.1) -> Advice:
    """The advice of ``change``, replayed at ``flops`` beside a baseline of :data:`FLOPS`, on a step this long."""
    variant = replayed(change, PREDICTED)
    assert variant.replayed is not None
    variant = replace(variant, replayed=replace(variant.replayed, flops=flops))
    simulation = simulated(variant, baseline=replace(BASELINE, flops=FLOPS))
    return with_time_cost(advice(), healthy_summary(step_seconds_median=step_seconds), simulation)


def test_checkpointing_costs_its_recomputed_forward_at_the_measured_step_time() -> None:
    found = priced(CheckpointChange(PLAN), 1_300_000)
    assert (found.flop_ratio, found.cost_basis) == (1.3, CostBasis.RECOMPUTED_FORWARD)
    assert found.estimated_cost_seconds == pytest.approx(0.03)
    assert found.cost_text == "costs about +30.0 ms a step (+30.0% FLOPs, recomputed forward)"
    unmeasured = priced(CheckpointChange(PLAN), 1_300_000, step_seconds=None)
    assert (unmeasured.estimated_cost_seconds, unmeasured.flop_ratio) == (None, 1.3)
    assert unmeasured.cost_text == "+30.0% FLOPs, recomputed forward; no step time measured to price it"


@pytest.mark.parametrize("change", [InplaceChange(("act",)), FreeGradientsChange()])
def test_a_change_that_runs_the_same_ops_costs_nothing_and_says_so(change: StepChange) -> None:
    found = priced(change, FLOPS)
    assert (found.estimated_cost_seconds, found.flop_ratio, found.cost_basis) == (0.0, 1.0, CostBasis.SAME_FLOPS)
    assert found.cost_text == "costs no step time (same FLOPs)"


def test_the_advice_s_own_kind_of_change_is_priced_where_two_replay_to_its_peak() -> None:
    inplace, checkpoint = (replayed(change, PREDICTED) for change in (InplaceChange(("act",)), CheckpointChange(PLAN)))
    assert inplace.replayed is not None and checkpoint.replayed is not None
    variants = (
        replace(inplace, replayed=replace(inplace.replayed, flops=FLOPS)),
        replace(checkpoint, replayed=replace(checkpoint.replayed, flops=1_300_000)),
    )
    simulation = simulated(*variants, baseline=replace(BASELINE, flops=FLOPS))
    found = with_time_cost(advice(), healthy_summary(), simulation)
    assert (found.flop_ratio, found.cost_basis) == (1.3, CostBasis.RECOMPUTED_FORWARD)
    inplace_advice = with_time_cost(advice(AdviceId.INPLACE_ACTIVATIONS), healthy_summary(), simulation)
    assert (inplace_advice.flop_ratio, inplace_advice.cost_basis) == (1.0, CostBasis.SAME_FLOPS)


def test_of_checkpointing_plans_replayed_to_the_advice_s_peak_the_advised_one_is_priced() -> None:
    # Two plans replay to the same peak: the advice gives the one recomputing less (fewer FLOPs, where no replay's
    # ops were priced), so its step time is that plan's, not the first one replayed (which recomputes a layer more).
    more = CheckpointChange(CheckpointPlan("network", (("0",), ("1",), ("2",)), None, GIB))
    variants = []
    for change, flops in ((more, 1_500_000), (CheckpointChange(PLAN), 1_300_000)):
        variant = replayed(change, PREDICTED)
        assert variant.replayed is not None
        variants.append(replace(variant, replayed=replace(variant.replayed, flops=flops)))
    simulation = simulated(*variants, baseline=replace(BASELINE, flops=FLOPS))
    found = with_time_cost(advice(), healthy_summary(), simulation)
    assert (found.flop_ratio, found.cost_basis) == (1.3, CostBasis.RECOMPUTED_FORWARD)


def test_a_halved_batch_with_accumulation_runs_two_half_steps() -> None:
    found = priced(BatchSizeChange(16), 520_000)  # half the batch, and what does not scale with it
    assert (found.flop_ratio, found.cost_basis) == (1.04, CostBasis.TWO_HALF_BATCHES)
    assert found.estimated_cost_seconds == pytest.approx(0.004)


@pytest.mark.parametrize(
    ("change", "basis", "text"),
    [
        (PrecisionChange("bf16-mixed"), CostBasis.OTHER_PRECISION, "(same FLOPs in another precision)"),
        (LengthChange(128), CostBasis.FEWER_TOKENS, "(fewer tokens a step: -40.0% FLOPs)"),
        (TokensPerBatchChange(4096), CostBasis.FEWER_TOKENS, "(fewer tokens a step: -40.0% FLOPs)"),
    ],
)
def test_a_change_of_what_is_computed_is_not_priced_from_flops(change: StepChange, basis: CostBasis, text: str) -> None:
    flops = FLOPS if isinstance(change, PrecisionChange) else 600_000
    found = priced(change, flops)
    assert (found.estimated_cost_seconds, found.cost_basis) == (None, basis)
    assert found.cost_text == f"step time not modelled from FLOPs {text}"


def test_simulated_allocator_settings_cost_nothing_and_no_replay_means_no_cost() -> None:
    simulation = simulated(baseline=replace(BASELINE, flops=FLOPS))
    fragmentation = advice(AdviceId.ALLOCATOR_FRAGMENTATION, predicted_peak_bytes=None)
    found = with_time_cost(fragmentation, healthy_summary(), simulation)
    assert (found.estimated_cost_seconds, found.flop_ratio, found.cost_basis) == (0.0, 1.0, CostBasis.SAME_FLOPS)
    modelled = replace(fragmentation, saving_basis=SavingBasis.MODELLED)
    assert with_time_cost(modelled, healthy_summary(), simulation) == modelled
    uncounted = simulated(replayed(CheckpointChange(PLAN), PREDICTED))  # FLOPs not counted
    assert with_time_cost(advice(), healthy_summary(), uncounted) == advice()
    assert with_time_cost(advice(), healthy_summary(), None) == advice()


def test_the_cost_is_written_and_read_back_and_older_advice_has_none() -> None:
    found = priced(CheckpointChange(PLAN), 1_300_000)
    written = advice_to_dict(found)
    assert written["flop_ratio"] == 1.3 and written["cost_basis"] == "recomputed forward"
    assert advice_from_dict(json.loads(json.dumps(written)), "advice[0]") == found
    older = {key: value for key, value in written.items() if key not in ("estimated_cost_seconds", "flop_ratio")}
    del older["cost_basis"]
    read = advice_from_dict(older, "advice[0]")
    assert (read.estimated_cost_seconds, read.flop_ratio, read.cost_basis) == (None, None, None)
    with pytest.raises(FormatError, match=r"advice\[0\]\.cost_basis"):
        advice_from_dict({**written, "cost_basis": "free lunch"}, "advice[0]")


def test_markdown_and_html_give_the_cost_its_own_line() -> None:
    found = priced(CheckpointChange(PLAN), 1_300_000)
    text = "costs about +30.0 ms a step (+30.0% FLOPs, recomputed forward)"
    assert f"\n**Time cost:** {text}\n" in advice_markdown((found,))
    assert f"<p><strong>Time cost:</strong> {text}</p>" in _advice_html(found)
    assert "Time cost" not in advice_markdown((advice(),)) + _advice_html(advice())


UNKNOWN_SPREAD = (
    "step times vary (interquartile range over the median) not recorded in A, not recorded in B: reliability unknown"
)
"""What the diff says of two reports written before the step times' spread was recorded (0.10.0's)."""


def _timed(report: Report, seconds: float | None) -> Report:
    return replace(report, summary=replace(report.summary, step_seconds_median=seconds))


@pytest.mark.parametrize(
    ("after_seconds", "verdict"),
    [(0.128, "within"), (0.137, "within"), (0.138, "outside"), (0.1, "outside"), (0.122, "outside")],
)
def test_diff_judges_the_measured_step_time_against_the_predicted_cost(after_seconds: float, verdict: str) -> None:
    report = load_report(Path(__file__).parent / "data" / "reports" / "0.10.0" / "cpu.json")
    found = priced(CheckpointChange(PLAN), 1_300_000)  # +30 ms on a 100 ms step; 25% of it is 7.5 ms
    line = time_line(found, _timed(report, 0.1), _timed(report, after_seconds))
    assert line == (
        "step time (activation-checkpointing): A's replay predicted +30.0 ms a step (+30.0% FLOPs, recomputed"
        f" forward), B's median step took {1000 * (after_seconds - 0.1):+.1f} ms (100.0 ms ->"
        f" {1000 * after_seconds:.1f} ms); the cost measured {1000 * (after_seconds - 0.1):+.1f} ms for +30.0 ms"
        f" predicted: {verdict} the tolerance of 25.0% or 1 ms; {UNKNOWN_SPREAD}"
    )


def test_diff_allows_a_millisecond_on_a_tiny_step_and_gives_no_verdict_without_timing() -> None:
    report = load_report(Path(__file__).parent / "data" / "reports" / "0.10.0" / "cpu.json")
    tiny = priced(CheckpointChange(PLAN), 1_300_000, step_seconds=0.002)  # +0.6 ms
    assert time_line(tiny, _timed(report, 0.002), _timed(report, 0.0035)).endswith(
        f" predicted: within the tolerance of 25.0% or 1 ms; {UNKNOWN_SPREAD}"
    )
    assert time_line(tiny, _timed(report, 0.002), _timed(report, 0.0037)).endswith(
        f" predicted: outside the tolerance of 25.0% or 1 ms; {UNKNOWN_SPREAD}"
    )
    assert time_line(tiny, _timed(report, None), _timed(report, 0.003)).endswith(", step time not recorded")
    precision = priced(PrecisionChange("bf16-mixed"), FLOPS)
    assert time_line(precision, _timed(report, 0.1), _timed(report, 0.08)) == (
        "step time (activation-checkpointing): A's advice said step time not modelled from FLOPs (same FLOPs in"
        f" another precision); B's median step took -20.0 ms (100.0 ms -> 80.0 ms); {UNKNOWN_SPREAD}"
    )


def test_the_views_show_the_predicted_step_time_where_set() -> None:
    found = replace(priced(CheckpointChange(PLAN), 1_300_000), predicted_step_seconds=0.1234)
    text = "predicted step 123.4 ms with the change (roofline, calibrated by this run)"
    assert f"\n**Step time:** {text}\n" in advice_markdown((found,))
    assert f"<p><strong>Step time:</strong> {text}</p>" in _advice_html(found)
    assert advice_summary(found).endswith(f"; {text})")
    assert "Step time" not in advice_markdown((advice(),)) + _advice_html(advice())
    assert "predicted step" not in advice_summary(advice())
    report = load_report(Path(__file__).parent / "data" / "reports" / "0.10.0" / "cpu.json")
    line = time_line(found, _timed(report, 0.1), _timed(report, 0.128))
    assert (
        "(100.0 ms -> 128.0 ms); the cost measured +28.0 ms for +30.0 ms predicted: within the tolerance of 25.0% or"
        " 1 ms; predicted step with the change 123.4 ms; "
    ) in line
    assert "predicted step" not in time_line(found, _timed(report, 0.1), _timed(report, None))


def test_diff_gives_no_step_time_verdict_where_a_run_s_step_times_are_not_reliable() -> None:
    # A new user's trial: "the cost measured +1710.4 ms for +12.0 ms predicted: outside the tolerance ...; ... 90.4% in
    # B: not reliable": a verdict on timings the same line calls unreliable.
    report = load_report(Path(__file__).parent / "data" / "reports" / "0.10.0" / "cpu.json")
    found = priced(CheckpointChange(PLAN), 1_300_000)  # +30 ms on a 100 ms step

    def spread(seconds: float, fraction: float) -> Report:
        timed = _timed(report, seconds)
        return replace(timed, summary=replace(timed.summary, step_time_iqr_fraction=fraction))

    noisy = time_line(found, spread(0.1, 0.04), spread(1.81, 0.904))
    assert (
        "; the cost measured +1710.0 ms for +30.0 ms predicted: no verdict, the step times are not reliable;" in noisy
    )
    assert "tolerance" not in noisy and noisy.endswith(
        "90.4% in B: not reliable, over 25.0% in B (a machine loaded by"
        " other work times steps unevenly; measure again on a quiet one)"
    )
    quiet = time_line(found, spread(0.1, 0.04), spread(0.128, 0.05))
    assert "predicted: within the tolerance of 25.0% or 1 ms; " in quiet and quiet.endswith(
        ": within 25.0%, steady within each run (a load that changed between the runs is not seen here)"
    )
