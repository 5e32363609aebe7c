"""The rule protocol, and the readings and thresholds several rules share.

A rule reads a :class:`~lightning_vram.records.RunSummary`, a :class:`~lightning_vram.records.TrainingSetup` and
the replay of the run's step (a :class:`~lightning_vram.records.Simulation`, or ``None``), and returns one
:class:`~lightning_vram.records.Advice` with the figures that fired it and the saving it expects, or ``None``. A
rule whose evidence was not measured here (no GPU, no NVML, no sampled step) stays silent; so does one whose saving
would be too small to matter. Thresholds are named constants (the README gives the reason for each).

A rule that stays silent says why in one line (its ``why_not``): a change it had replayed, with the replay's figure
(:func:`replayed_figure`); one it could not, with why (:func:`not_replayed`) and its modelled figure where it has one;
or a measured share against its threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lightning_vram.advice.savings import SHOWN_REASON_CHARACTERS, Discarded, change_key, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    Breakdown,
    PhasePeak,
    RunSummary,
    Simulation,
    StepChange,
    TrainingSetup,
)
from lightning_vram.records.simulation import NOT_REPLAYED
from lightning_vram.units import format_bytes, format_percent

MIN_SAVING_SHARE = 0.05
"""Advice that would save less than this share of the peak is noise next to run-to-run variation."""
NEAR_CAPACITY_SHARE = 0.9
"""A peak above 90% of capacity is one larger batch or input away from out-of-memory."""
DATA_WAIT_WORKERS_SHARE = 0.10
"""A GPU idle a tenth of every step waiting for data is worth more DataLoader workers."""
DATA_WAIT_MIN_SECONDS = 0.002
"""...and from 2 ms of waiting per step: Lightning's own loop takes about 0.5 ms between batches (measured on a
small CPU, with fast in-memory data), which no DataLoader setting removes."""
MIN_TIMED_STEPS = 10
"""Data-wait rules need at least this many timed steps, so one slow start does not fire them."""

Advise = Callable[[RunSummary, TrainingSetup, Simulation | None], Advice | None]
"""The run's summary, its training set-up and the replay of its step (``None`` without one) -> advice or ``None``."""
Changes = Callable[[RunSummary, TrainingSetup], tuple[StepChange, ...]]
"""The run's summary and training set-up -> the changes a rule wants replayed on the run's step."""
WhyNot = Callable[[RunSummary, TrainingSetup, Simulation | None], str | None]
"""The same readings as :data:`Advise` -> why the rule, silent on this run, did not advise what it weighed (one line),
or ``None`` when it weighed nothing worth a word (nothing replayed, nothing measured)."""


def no_reason(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None) -> str | None:
    """The ``why_not`` of a rule that weighs no remedy worth explaining when it stays silent."""
    return None


@dataclass(frozen=True)
class Rule:
    """One piece of advice: its stable ``id``, the ``changes`` it wants replayed, and the function that advises.

    ``advise`` reads the saving of each change it declared through
    :func:`~lightning_vram.advice.savings.resolve_saving`; the session replays the union of every rule's
    ``changes`` (:func:`~lightning_vram.advice.rules.registry.changes_to_replay`), so a declared change is
    replayed whenever the time budget allows. ``why_not`` says, when ``advise`` gives nothing, why (every rule of the
    registry has one: a rule that applies to the run is either advised or answered, replayed or not).
    """

    id: AdviceId
    advise: Advise
    changes: Changes
    why_not: WhyNot = no_reason


def no_changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """The changes of a rule that wants none replayed (it advises from the measurements alone)."""
    return ()


def attributed_peak(summary: RunSummary) -> tuple[PhasePeak, Breakdown] | None:
    """The run's peak with its breakdown into parts, or ``None`` when either was not measured."""
    peak = summary.peak
    if peak is None or peak.breakdown is None or peak.peak_bytes <= 0:
        return None
    return peak, peak.breakdown


def share_text(part: int, whole: int) -> str:
    """``part`` as a percentage of ``whole`` (both in bytes), in words.

    >>> share_text(1, 4), share_text(1, 0)
    ('25.0%', 'n/a')
    """
    return format_percent(part / whole) if whole else "n/a"


def sustained_data_wait(summary: RunSummary, threshold: float) -> bool:
    """Whether the step waited for data ``threshold`` of its time or more, over the run and recently, long enough."""
    run, recent, step = summary.data_wait_fraction, summary.recent_data_wait_fraction, summary.step_seconds_median
    return (
        summary.timed_steps >= MIN_TIMED_STEPS
        and run is not None
        and recent is not None
        and step is not None
        and run >= threshold
        and recent >= threshold
        and run * step >= DATA_WAIT_MIN_SECONDS
    )


def replayed_figure(simulation: Simulation | None, change: StepChange) -> str | None:
    """What the replay of ``change`` predicts, in words, as the report's simulation table shows it; ``None`` unreplayed.

    The replayed peak with the change, and how far it lies from the replayed baseline's peak (both as the report
    measures peaks: :meth:`~lightning_vram.records.ReplayedStep.reported_bytes`); a replay that raised says so.
    """
    found = resolve_saving(simulation, change, modelled=None)
    if isinstance(found, Discarded):
        return found.evidence.removeprefix("; not advised, ")
    if found is None or found.predicted_peak_bytes is None:
        return None
    saving = found.saving_bytes
    direction = "below" if saving >= 0 else "above"
    return (
        f"replayed, {change.label} peaks at {format_bytes(found.predicted_peak_bytes)},"
        f" {format_bytes(abs(saving))} ({share_text(abs(saving), found.peak_bytes)}) {direction} the replayed"
        f" baseline's {format_bytes(found.peak_bytes)}"
    )


def not_replayed(simulation: Simulation | None, change: StepChange | None = None) -> str:
    """Why ``change`` (``None``: the step itself) has no replayed figure, in words (a long reason shortened).

    >>> not_replayed(None)
    'not weighed by replay: no step was replayed (the replay is off, or no sampled step reached it)'
    """
    if simulation is None:
        cause = "no step was replayed (the replay is off, or no sampled step reached it)"
    elif simulation.skipped is not None or simulation.baseline is None:
        cause = f"the step was not replayed ({shortened(simulation.skipped or 'its replay gave no result')})"
    else:
        variant = next(
            (
                item
                for item in simulation.variants
                if change is not None and change_key(item.change) == change_key(change)
            ),
            None,
        )
        untried = variant.discarded if variant is not None and variant.discarded else None
        cause = f"{change.label if change is not None else 'the change'}: {untried or NOT_REPLAYED}"
    return f"not weighed by replay: {cause}"


def shortened(text: str) -> str:
    """``text`` cut to :data:`~lightning_vram.advice.savings.SHOWN_REASON_CHARACTERS`, ending in an ellipsis.

    >>> shortened("short")
    'short'
    """
    return text if len(text) <= SHOWN_REASON_CHARACTERS else text[: SHOWN_REASON_CHARACTERS - 1] + "…"


def replayed_reason(simulation: Simulation | None, declared: Iterable[StepChange], why: str) -> str | None:
    """``why`` a rule stayed silent, after the figure of each of the ``declared`` changes.

    A change the simulation replayed gives the replay's figure (:func:`replayed_figure`), one it did not says why
    (:func:`not_replayed`). ``None`` when none was declared (nothing weighed, nothing to answer).
    """
    figures = [replayed_figure(simulation, change) or not_replayed(simulation, change) for change in declared]
    return f"{'; '.join(dict.fromkeys(figures))}: {why}" if figures else None


def data_wait_reason(summary: RunSummary, threshold: float) -> str | None:
    """Why the measured data wait does not reach ``threshold`` (:func:`sustained_data_wait`), with its share.

    ``None`` when the data wait was not measured.
    """
    run, recent, step = summary.data_wait_fraction, summary.recent_data_wait_fraction, summary.step_seconds_median
    if run is None or step is None:
        return None
    measured = f"data wait is {format_percent(run)} of step time ({1000 * run * step:.1f} ms per step)"
    if run < threshold:
        return f"{measured}, under the {format_percent(threshold)} the rule needs"
    if run * step < DATA_WAIT_MIN_SECONDS:
        return f"{measured}, under the {1000 * DATA_WAIT_MIN_SECONDS:.0f} ms per step the rule needs"
    if recent is not None and recent < threshold:
        return f"{measured} over the run but {format_percent(recent)} recently, under the {format_percent(threshold)}"
    return f"{measured}, over {summary.timed_steps} timed steps: fewer than the {MIN_TIMED_STEPS} the rule needs"
