"""Long tail of batch lengths: a few batches far longer than the rest set the peak.

Read from the run's batch lengths (:attr:`~lightning_vram.records.RunSummary.length_counts`): where the longest
batch is :data:`TAIL_RATIO` times the length :data:`TAIL_SHARE` of the batches do not exceed, the worst batch is
replayed cut to that length (a :class:`~lightning_vram.records.LengthChange`), and the rule fires when that lowers
the replayed peak by :data:`~lightning_vram.advice.rules.base.MIN_SAVING_SHARE`. The saving is always replayed:
there is no model of it.
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, Rule
from lightning_vram.advice.savings import Saving, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    LengthChange,
    RunSummary,
    Severity,
    Simulation,
    StepChange,
    TrainingSetup,
)
from lightning_vram.records.shapes import length_percentile
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.LONG_TAIL
TAIL_SHARE = 0.95
"""The cap offered: the length this share of the run's batches do not exceed (its 95th percentile)."""
TAIL_RATIO = 1.5
"""The longest batch must be this many times the cap for the tail to be worth cutting."""


def _cap(summary: RunSummary) -> tuple[int, int] | None:
    """The cap (the lengths' :data:`TAIL_SHARE` percentile) and the longest length, tokens; ``None``: no long tail."""
    counts = summary.length_counts
    cap = length_percentile(counts, TAIL_SHARE)
    if cap is None:
        return None
    longest = max(length for length, _ in counts)
    return (cap, longest) if longest >= TAIL_RATIO * cap else None


def long_tail_changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """The worst batch cut to the cap, where the longest batch is well past it."""
    found = _cap(summary)
    return (LengthChange(found[0]),) if found is not None else ()


def _replayed_cap(simulation: Simulation | None) -> LengthChange | None:
    """The cap the simulation replayed (declared from the lengths seen when the worst batch was replayed)."""
    if simulation is None:
        return None
    return next((variant.change for variant in simulation.variants if isinstance(variant.change, LengthChange)), None)


def long_tail(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """A few batches far longer than the rest, and the worst one replayed cut to the rest's length saves enough."""
    change = _replayed_cap(simulation)
    found = _cap(summary)
    if change is None or found is None:
        return None
    counts = summary.length_counts
    total = sum(count for _, count in counts)
    within = sum(count for length, count in counts if length <= change.length)
    longest = found[1]
    if within < TAIL_SHARE * total:  # the lengths seen since the replay moved the percentile past its cap
        return None
    saving = resolve_saving(simulation, change, None, measured=summary.peak)
    if not isinstance(saving, Saving) or not saving.at_least(MIN_SAVING_SHARE):
        return None
    cap = change.length
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=f"Cap sequences at {cap} tokens to lower the peak by about {format_bytes(saving.saving_bytes)}",
        detail=(
            f"{format_percent(within / total)} of the batches are at most {cap} tokens long, but the longest is"
            f" {longest}: the few long ones set the peak. Truncate in the tokenizer or the collator, or bucket"
            " samples by length (or batch by tokens per batch) so a long batch holds fewer sequences.\n"
            "```python\n"
            f"tokenizer(texts, max_length={cap}, truncation=True)  # or, in a collate function:\n"
            f"batch = {{key: value[:, :{cap}] for key, value in batch.items()}}\n"
            "```"
        ),
        evidence=(
            f"batch lengths seen: {total} batches, {within} of them at most {cap} tokens, the longest {longest};"
            f" {saving.evidence}"
        ),
        estimated_saving_bytes=saving.saving_bytes,
        saving_basis=saving.basis,
    )


RULE = Rule(ID, long_tail, long_tail_changes)
