"""The report: a run's summary with what is derived from it (advice, the fit table, the top modules)."""

from __future__ import annotations

from dataclasses import replace

from lightning_vram.advice.capacity import fit_table
from lightning_vram.advice.rules.registry import advise, not_advised
from lightning_vram.records import (
    ModuleProfile,
    NotMeasured,
    RankSummary,
    Report,
    RunSummary,
    Simulation,
    TrainingSetup,
)


def largest_savers(profiles: tuple[ModuleProfile, ...]) -> tuple[ModuleProfile, ...]:
    """The modules that saved activations themselves, largest first; ties keep the order the modules ran in.

    >>> rows = (ModuleProfile("blocks.2", "Block", 5), ModuleProfile("blocks.10", "Block", 5),
    ...         ModuleProfile("head", "Linear", 9), ModuleProfile("act", "ReLU", 0))
    >>> [row.name for row in largest_savers(rows)]
    ['head', 'blocks.2', 'blocks.10']
    """
    savers = [profile for profile in profiles if profile.activation_bytes > 0]
    return tuple(sorted(savers, key=lambda profile: -profile.activation_bytes))


def build_report(
    summary: RunSummary,
    setup: TrainingSetup | None,
    *,
    top_modules: int,
    ranks: tuple[RankSummary, ...],
    not_measured: tuple[NotMeasured, ...],
    simulation: Simulation | None = None,
) -> Report:
    """The report of ``summary``: advice needs the training set-up (without one, no advice is given).

    ``simulation`` is the replay of the run's sampled step and of the changes tried on it: the advice and the fit
    table use its savings where it has them, and the report carries it.
    """
    advice = advise(summary, setup, simulation) if setup is not None else ()
    if setup is not None:  # the report's header says what a step is under accumulation
        summary = replace(summary, accumulate_grad_batches=setup.accumulate_grad_batches)
    return Report(
        summary=summary,
        precision=setup.precision if setup is not None else None,
        modules=largest_savers(summary.modules)[:top_modules],
        advice=advice,
        fit=fit_table(
            summary,
            simulation,
            setup.accumulate_grad_batches if setup is not None else 1,
            own_accumulation=setup is not None and not setup.lightning_accumulates,
        ),
        ranks=ranks,
        not_measured=not_measured,
        simulation=simulation,
        not_advised=not_advised(summary, setup, simulation, advice) if setup is not None else (),
    )
