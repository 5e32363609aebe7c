"""``lightning-vram diff`` against a run that stopped: its advice is not compared as if the change had fixed it.

A new user's trial (the fourteenth session) applied the chunked-loss advice to a GPT-NeoX model with the wrong
head's name; the run died at its first step with ``AttributeError``. ``lightning-vram diff`` then read "peak: 339.2
MiB -> n/a" and "advice removed: activation-checkpointing", "advice removed: chunked-loss", and nowhere said that run
B had stopped: the advice was gone because no step was measured, not because the change worked.
"""

from __future__ import annotations

from dataclasses import replace

from advice_summaries import healthy_summary

from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.records import Advice, AdviceId, Report, Severity
from lightning_vram.render.diff import diff_text

STOPPED = "AttributeError: 'GPTNeoXForCausalLM' object has no attribute 'embed_out'"


def advice(advice_id: AdviceId) -> Advice:
    return Advice(advice_id, Severity.INFO, f"{advice_id.value} title", "detail", "evidence", 1024)


def report(*, advised: tuple[AdviceId, ...], ended_with: str | None = None, measured: bool = True) -> Report:
    """A run's report as its JSON reads back: ``measured=False`` is a run that measured no step."""
    summary = healthy_summary()
    if not measured:
        summary = replace(summary, peak=None, phases={}, steps=0, step_seconds_median=None, data_wait_fraction=None)
    written = Report(summary, "32-true", (), tuple(advice(item) for item in advised), (), (), ended_with=ended_with)
    return report_from_dict(report_to_dict(written))


BOTH = (AdviceId.CHUNKED_LOSS, AdviceId.ACTIVATION_CHECKPOINTING)


def test_a_run_that_measured_no_step_has_its_advice_not_compared() -> None:
    lines = diff_text(report(advised=BOTH), report(advised=(), ended_with=STOPPED, measured=False)).splitlines()
    assert not [line for line in lines if line.startswith("advice removed")], lines
    assert (
        "advice: not compared: B measured no training step (it stopped with"
        f" {STOPPED}); A advised activation-checkpointing, chunked-loss"
    ) in lines
    assert f"  run ended: finished -> stopped with {STOPPED}" in lines


def test_advice_removed_in_a_run_that_stopped_says_so() -> None:
    lines = diff_text(report(advised=BOTH), report(advised=BOTH[1:], ended_with=STOPPED)).splitlines()
    assert ("advice removed: chunked-loss (B stopped with an error: its advice covers its steps until then)") in lines
    assert f"  run ended: finished -> stopped with {STOPPED}" in lines


def test_runs_that_both_finished_have_no_ending_line() -> None:
    lines = diff_text(report(advised=BOTH), report(advised=BOTH[1:])).splitlines()
    assert "advice removed: chunked-loss" in lines
    assert not [line for line in lines if "run ended" in line]


def test_a_run_the_user_interrupted_is_not_said_to_have_stopped_with_an_error() -> None:
    """Ctrl-C (Lightning's graceful shutdown records KeyboardInterrupt) is no error of the run's."""
    lines = diff_text(report(advised=BOTH), report(advised=BOTH[1:], ended_with="KeyboardInterrupt")).splitlines()
    # Before: 'advice removed: chunked-loss (B stopped with an error: its advice covers its steps until then)'.
    assert (
        "advice removed: chunked-loss (B was interrupted (KeyboardInterrupt): its advice covers its steps until then)"
    ) in lines
    assert "  run ended: finished -> stopped with KeyboardInterrupt" in lines
