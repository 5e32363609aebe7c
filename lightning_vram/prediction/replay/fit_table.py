"""The fit table by replay: for each common GPU, the largest batch whose replayed step fits beside the CUDA context.

Every GPU's row comes from one search (:func:`~lightning_vram.prediction.replay.search.largest_batches_that_fit`): two
replays give a line per phase (forward, backward, optimizer step), a third checks them, and only the rows the lines
cannot settle are replayed around their answer.
When the time budget runs out, or a replay fails, the rows already settled are kept and the search says why the
others are missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_vram.measure.tensors import batch_size_of
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, COMMON_GPUS
from lightning_vram.prediction.replay.search import MAX_BATCH_SIZE, PhasePeaks, largest_batches_that_fit
from lightning_vram.prediction.replay.simulation import BUDGET_RAN_OUT, Replays
from lightning_vram.records import BatchSizeChange, FitRow, Phase, ReplayedStep, SavingBasis


@dataclass(frozen=True)
class FitSearch:
    """The fit table's search: a row per GPU asked for, the replays it ran, and why rows are missing.

    ``rows`` holds ``None`` where a GPU's row was not found; ``missing`` is ``None`` when none is.
    """

    rows: tuple[FitRow | None, ...]
    replays: int
    missing: str | None = None

    @property
    def found(self) -> tuple[FitRow, ...]:
        """The rows found, in the order asked for."""
        return tuple(row for row in self.rows if row is not None)


def replayed_fit_table(
    replays: Replays,
    *,
    context_bytes: int,
    gpus: Sequence[tuple[str, int]] = COMMON_GPUS,
    known_steps: Mapping[int, ReplayedStep] | None = None,
) -> FitSearch:
    """The largest batch per GPU whose replayed peak plus ``context_bytes`` leaves the safety margin free.

    A row is missing where the batch has no batch dimension, a replay it needed failed, or the replays' budget ran
    out first; :attr:`FitSearch.missing` says which. ``known_steps`` are steps already replayed with these settings,
    by batch size (the baseline, a batch-size change): not replayed again.
    """
    batch = replays.batch
    start = batch_size_of(batch)
    if start is None:
        return FitSearch((None,) * len(gpus), 0, "the batch has no batch dimension to vary")
    failures: list[str] = []

    def peak_bytes(size: int) -> PhasePeaks | None:
        if replays.out_of_time():
            failures.append(BUDGET_RAN_OUT)
            return None
        result = replays.replay(BatchSizeChange(size))
        if isinstance(result, ReplayedStep):
            return phase_peaks(result)
        out_of_time = replays.out_of_time()
        failures.append(BUDGET_RAN_OUT if out_of_time else f"the replay of batch size {size} failed: {result.reason}")
        return None

    budgets = [int(capacity * (1 - BATCH_SAFETY_MARGIN)) - context_bytes for _, capacity in gpus]
    known = {size: phase_peaks(step) for size, step in (known_steps or {}).items()}
    sizes, count = largest_batches_that_fit(peak_bytes, budgets, start, known=known)
    rows = tuple(
        None
        if size is None
        else FitRow(name, capacity, size, basis=SavingBasis.SIMULATED, at_least=size >= MAX_BATCH_SIZE)
        for (name, capacity), size in zip(gpus, sizes, strict=True)
    )
    missing = None
    if None in sizes:
        left_out = [name for (name, _), size in zip(gpus, sizes, strict=True) if size is None]
        reason = failures[0] if failures else "a replay failed"
        missing = f"{reason}; no row for {', '.join(left_out)}"
    return FitSearch(rows, count, missing)


def phase_peaks(step: ReplayedStep) -> PhasePeaks:
    """A replayed step's peak per phase, bytes, in step order (0 for a phase the step did not reach)."""
    return tuple(step.phases[phase].peak_bytes if phase in step.phases else 0 for phase in Phase)
