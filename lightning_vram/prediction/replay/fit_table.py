"""The fit table by replay: for each common GPU, the largest batch whose replayed step fits beside the CUDA context.

Where the caching allocator is simulated (on CUDA), "fits" means the simulated allocator serves the whole step
(:func:`~lightning_vram.prediction.replay.serves.serve`) at the card's memory less the CUDA context, with no margin
kept: what the allocator holds around the tensors is in the simulation, not guessed. Every row is searched in the
simulator on sequences synthesized from two replays (:class:`~lightning_vram.prediction.replay.synthesis.AffineSteps`),
and the table's largest answer and the batch above it are replayed to confirm the synthesis: two replays for the
whole table, not two per row and setting (each row's own confirmed only where that check disagrees). Where the
synthesis does not hold, lines on the replayed reserved peaks seed a search by replays
(:func:`~lightning_vram.prediction.replay.search.largest_batches_that_fit`), checked in the simulator, the batch
above each answer shown not to be served. Each row is searched with the run's settings and with
``expandable_segments:True`` on the same replays.

Where it is not (no allocator settings: the CPU's tensor peaks), a row is the largest batch whose replayed peak plus
the context leaves :data:`~lightning_vram.prediction.devices.BATCH_SAFETY_MARGIN` of the card free, solved on the
lines alone.

When the time budget runs out, or a replay fails, the rows already settled are kept and the search says why the
others are missing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from lightning_vram.measure.tensors import batch_size_of, time_major
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, COMMON_GPUS
from lightning_vram.prediction.replay.calibration import unseen_at
from lightning_vram.prediction.replay.search import MAX_BATCH_SIZE, PhasePeaks, largest_batches_that_fit
from lightning_vram.prediction.replay.served_range import ServedRange, served_range
from lightning_vram.prediction.replay.serves import ServingMemo, serve
from lightning_vram.prediction.replay.simulation import BUDGET_RAN_OUT, Replays
from lightning_vram.prediction.replay.synthesis import AffineSteps
from lightning_vram.records import AllocationSequence, BatchSizeChange, FitRow, Phase, ReplayedStep, SavingBasis


@dataclass(frozen=True)
class FitSearch:
    """The fit table's search: a row per GPU asked for, the replays it ran, and why rows are missing.

    ``rows`` holds ``None`` where a GPU's row was not found; ``missing`` is ``None`` when none is; ``notes`` says
    which rows fell back to the replay-based search.
    """

    rows: tuple[FitRow | None, ...]
    replays: int
    missing: str | None = None
    notes: tuple[str, ...] = ()
    """Where a row was searched by replays because the synthesized sequences disagreed with a replay."""

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
    unseen_bytes: Mapping[Phase, int] | None = None,
) -> FitSearch:
    """The largest batch per GPU whose replayed step fits beside ``context_bytes`` (see the module's docstring).

    A row is missing where the batch has no batch dimension (or one past the first: a time-major batch,
    :func:`~lightning_vram.measure.tensors.time_major`), a replay it needed failed, or the replays' budget ran out
    first; :attr:`FitSearch.missing` says which. ``known_steps`` are steps already replayed with these settings,
    by batch size (the baseline, a batch-size change): not replayed again. ``unseen_bytes``: per phase, bytes the
    replay cannot see (measured by the calibration), held through the phase in the simulated allocator.
    """
    start = batch_size_of(replays.batch)
    if start is None:
        return FitSearch((None,) * len(gpus), 0, "the batch has no batch dimension to vary")
    reversed_batch = time_major(replays.batch)
    if reversed_batch is not None:
        return FitSearch((None,) * len(gpus), 0, f"the batch's first dimension is not its batch: {reversed_batch}")
    steps = _Steps(replays, known_steps)
    settings = replays.allocator
    notes: tuple[str, ...] = ()
    if settings is None:
        budgets = [int(capacity * (1 - BATCH_SAFETY_MARGIN)) - context_bytes for _, capacity in gpus]
        sizes, _ = largest_batches_that_fit(
            steps.peaks(reserved=False), budgets, start, known=steps.known(reserved=False)
        )
        rows = tuple(
            None
            if size is None
            else FitRow(name, capacity, size, basis=SavingBasis.SIMULATED, at_least=size >= MAX_BATCH_SIZE)
            for (name, capacity), size in zip(gpus, sizes, strict=True)
        )
    else:
        rows, notes = _allocator_rows(steps, gpus, context_bytes, start, settings, unseen_bytes)
    missing = None
    if None in rows:
        left_out = [name for (name, _), row in zip(gpus, rows, strict=True) if row is None]
        reason = steps.failures[0] if steps.failures else "a replay failed"
        missing = f"{reason}; no row for {', '.join(left_out)}"
    return FitSearch(rows, steps.replays, missing, notes)


def _allocator_rows(
    steps: _Steps,
    gpus: Sequence[tuple[str, int]],
    context_bytes: int,
    start: int,
    settings: AllocatorSettings,
    unseen_bytes: Mapping[Phase, int] | None,
) -> tuple[tuple[FitRow | None, ...], tuple[str, ...]]:
    """The rows where the allocator is simulated: searched on synthesized sequences, confirmed by replay.

    Two replays (the run's batch and another) give every batch's sequence (:class:`AffineSteps`); each row is
    searched in the simulator alone (with the run's settings and with expandable segments). The table's largest
    answer is then replayed, with the batch above it: both must have the synthesized sequence exactly, the answer's
    served and the next's not. The law then holds at three batches spanning every row, so the other rows stand on
    it without replays of their own. Where that check disagrees, each row's answers are confirmed the same way, and
    a row whose confirmation disagrees, and every row where the two replays' structures differ, is searched as before
    (lines on the replayed peaks, then a replay per candidate); ``notes`` says which.
    """
    capacities = [capacity - context_bytes for _, capacity in gpus]
    law = _law(steps, start)
    memo = ServingMemo()  # the law's servings at every row's capacity: each simulated once, some reused above
    answers = [
        None if law is None else _synthesized_answers(law, served, start, settings, unseen_bytes, memo)
        for served in capacities
    ]
    checked = law is not None and _largest_confirmed(steps, law, answers, capacities, start, settings, unseen_bytes)
    fallback = _Fallback(steps, capacities, start, unseen_bytes)
    expandable = replace(settings, expandable_segments=True)
    rows: list[FitRow | None] = []
    notes: list[str] = []
    for index, ((name, capacity), served, answer) in enumerate(zip(gpus, capacities, answers, strict=True)):
        confirmed = answer is not None and law is not None
        if confirmed and not checked and law is not None and answer is not None:
            confirmed = _row_confirmed(steps, law, answer, start, settings, served, unseen_bytes)
        if confirmed and answer is not None:
            rows.append(_served_fit_row(name, capacity, answer[0], answer[1], settings, answer[2]))
            continue
        if law is not None and steps.failures:
            rows.append(None)
            continue
        if law is not None:
            notes.append(f"{name}: a replay disagreed with the synthesized sequences; searched by replays")
        rows.append(fallback.row(index, name, capacity, (settings, expandable)))
    if law is None:
        notes.append("the step's allocations change structure with the batch size: every row searched by replays")
    return tuple(rows), tuple(notes)


def _law(steps: _Steps, start: int) -> AffineSteps | None:
    """The sequences' law through two replayed batch sizes other than the run's.

    The run's own is the baseline's replay, without its batch kept beside a changed one (a structure of its own).
    The two are those already kept, else twice and three times the run's.
    """
    candidates = [*steps.kept_sizes(), 2 * start, 3 * start, start - 1, start - 2]
    sizes = list(dict.fromkeys(size for size in candidates if size != start and 1 <= size <= MAX_BATCH_SIZE))[:2]
    if len(sizes) < 2:
        return None
    first, second = steps.allocations(sizes[0]), steps.allocations(sizes[1])
    if first is None or second is None:
        return None
    return AffineSteps.fit(first, sizes[0], second, sizes[1])


Answer = tuple[int, int, str | None]
"""A row's answers on synthesized sequences: the largest batch served with the run's settings, and with
expandable segments (the same where the run has them), and the row's note on gaps above them."""


def _synthesized_answers(
    law: AffineSteps,
    served_bytes: int,
    start: int,
    run: AllocatorSettings,
    unseen_bytes: Mapping[Phase, int] | None,
    memo: ServingMemo | None = None,
) -> Answer | None:
    """One GPU's answers searched on synthesized sequences from ``start`` (no replay); ``None`` where none is found.

    ``served_bytes``: the bytes the allocator may hold there; ``memo``: the law's servings (shared by the rows).
    """
    expandable = replace(run, expandable_segments=True)
    # The search's bound is checked first: a card the step never outgrows costs one serve, any other a bisection;
    # then every batch below the answer down to the run's is checked (serving is not monotone in the batch).
    found = largest_served(
        law.at, run, served_bytes, start, unseen_bytes, ceiling=MAX_BATCH_SIZE, run_batch=start, memo=memo
    )
    if found is None:
        return None
    ranges = [served_range(law.at, run, served_bytes, start, found, unseen_bytes, memo)]
    if run != expandable:
        found = largest_served(
            law.at, expandable, served_bytes, found, unseen_bytes, ceiling=MAX_BATCH_SIZE, run_batch=start, memo=memo
        )
        if found is None:
            return None
        ranges.append(served_range(law.at, expandable, served_bytes, start, found, unseen_bytes, memo))
    return ranges[0].largest, ranges[-1].largest, _gaps_note(ranges)


def _largest_confirmed(
    steps: _Steps,
    law: AffineSteps,
    answers: Sequence[Answer | None],
    capacities: Sequence[int],
    start: int,
    run: AllocatorSettings,
    unseen_bytes: Mapping[Phase, int] | None,
) -> bool:
    """Whether replays agree with the table's largest answer and the batch above it (see :func:`_confirmed`).

    ``False`` where a row has no answer: every row is then confirmed on its own.
    """
    if not answers or any(answer is None for answer in answers):
        return False
    expandable = replace(run, expandable_segments=True)
    candidates = [
        (size, settings, served)
        for answer, served in zip(answers, capacities, strict=True)
        if answer is not None
        for size, settings in zip(answer[:2], (run, expandable), strict=True)
    ]
    size, settings, served = max(candidates, key=lambda candidate: candidate[0])
    return _confirmed(steps, law, size, start, settings, served, unseen_bytes)


def _row_confirmed(
    steps: _Steps,
    law: AffineSteps,
    answer: Answer,
    start: int,
    run: AllocatorSettings,
    served_bytes: int,
    unseen_bytes: Mapping[Phase, int] | None,
) -> bool:
    """Whether replays agree with one row's answers, with the run's settings and with expandable segments."""
    expandable = replace(run, expandable_segments=True)
    largest, wider, _ = answer
    if not _confirmed(steps, law, largest, start, run, served_bytes, unseen_bytes):
        return False
    return run == expandable or _confirmed(steps, law, wider, start, expandable, served_bytes, unseen_bytes)


def _gaps_note(ranges: Sequence[ServedRange]) -> str | None:
    """The row's note: where the served batches above its answers have gaps (the run's settings', expandable's)."""
    parts = [
        text if index == 0 else f"with expandable_segments:True {text}"
        for index, served in enumerate(ranges)
        if (text := served.text) is not None
    ]
    return "; ".join(parts) or None


def _served_fit_row(
    name: str, capacity_bytes: int, largest: int, wider: int | None, run: AllocatorSettings, note: str | None = None
) -> FitRow:
    """A row found by the simulated allocator, batch sizes.

    ``largest``: the largest batch it serves with the run's settings (``run``); ``wider``: with expandable segments;
    ``note``: where served batches above them have gaps. Why expandable segments serve fewer or more is said once
    for the table (:func:`~lightning_vram.records.advice.expandable_lines`).
    """
    return FitRow(
        name,
        capacity_bytes,
        largest,
        basis=SavingBasis.SIMULATED,
        at_least=largest >= MAX_BATCH_SIZE,
        allocator=run.conf(),
        expandable_max_batch_size=wider,
        note=note,
    )


def _confirmed(
    steps: _Steps,
    law: AffineSteps,
    largest: int,
    start: int,
    settings: AllocatorSettings,
    served_bytes: int,
    unseen_bytes: Mapping[Phase, int] | None,
) -> bool:
    """Whether replays agree with the synthesized answer ``largest``.

    The answer's replayed sequence must be the law's exactly and served, the next batch's too and not served (that
    one replayed while the budget allows, else the law's stands). A batch of 0 or past the search's bound is not
    replayed; the run's own (``start``, the baseline's replay) is checked for being served only.
    """
    for size, expected in ((largest, True), (largest + 1, False)):
        if size < 1 or size > MAX_BATCH_SIZE or (not expected and not steps.can_replay()):
            continue
        sequence = steps.allocations(size)
        if sequence is None or (size != start and not law.agrees(sequence, size)):
            return False
        if serve(sequence, settings, served_bytes, unseen_at(unseen_bytes or {}, start, size)).served is not expected:
            return False
    return True


class _Fallback:
    """The replay-based search: lines on the replayed peaks seed each row (searched once, when a row needs them)."""

    def __init__(
        self, steps: _Steps, capacities: Sequence[int], start: int, unseen_bytes: Mapping[Phase, int] | None
    ) -> None:
        self._steps = steps
        self._capacities = capacities
        self._start = start
        self._unseen_bytes = unseen_bytes
        self._seeds: tuple[tuple[int | None, ...], tuple[int | None, ...]] | None = None

    def row(
        self, index: int, name: str, capacity: int, settings: tuple[AllocatorSettings, AllocatorSettings]
    ) -> FitRow | None:
        """The row of GPU ``index`` as the replay-based search finds it."""
        if self._seeds is None:
            steps, start = self._steps, self._start
            unseen = max((self._unseen_bytes or {}).values(), default=0)
            budgets = [served - unseen for served in self._capacities]
            seeds, _ = largest_batches_that_fit(steps.peaks(reserved=True), budgets, start, known=steps.known())
            # Expandable segments hold little beyond the tensors: lines on the tensor peaks seed their search.
            wide, _ = largest_batches_that_fit(
                steps.peaks(reserved=False), budgets, start, known=steps.known(reserved=False)
            )
            self._seeds = (seeds, wide)
        seeds, wide = self._seeds
        served = self._capacities[index]
        seed = (seeds[index], wide[index])
        return _served_row(self._steps, name, (capacity, served), seed, settings, self._unseen_bytes, self._start)


KEPT_SEQUENCES = 16
"""Most replays whose allocation sequences the search keeps at once (the most recently used): a sequence is a few
events per op, and the served checks of a row need only the batches around its answer. One dropped and needed
again is replayed again."""


class _Steps:
    """The fit table's replays by batch size, each replayed once (``None``: failed or out of time), and why not.

    Every replay's peaks per phase are kept; its allocation sequence only for the :data:`KEPT_SEQUENCES` most
    recently used.
    """

    def __init__(self, replays: Replays, known: Mapping[int, ReplayedStep] | None) -> None:
        self._replays = replays
        keep = replays.allocator is None
        self._peaks: dict[int, tuple[PhasePeaks, PhasePeaks] | None] = {}
        self._sequences: OrderedDict[int, AllocationSequence] = OrderedDict()
        for size, step in (known or {}).items():
            if keep or step.allocations is not None:
                self._keep(size, step)
        self.replays = 0
        """How many replays the search ran (known steps not counted)."""
        self.failures: list[str] = []

    def _keep(self, size: int, step: ReplayedStep | None) -> None:
        self._peaks[size] = None if step is None else (phase_peaks(step), phase_peaks(step, reserved=True))
        if step is not None and step.allocations is not None:
            self._sequences[size] = step.allocations
            while len(self._sequences) > KEPT_SEQUENCES:
                self._sequences.popitem(last=False)

    def kept_sizes(self) -> list[int]:
        """The batch sizes whose sequences are kept."""
        return list(self._sequences)

    def can_replay(self) -> bool:
        """Whether the replays' time budget allows another."""
        return not self._replays.out_of_time()

    def known(self, reserved: bool = True) -> dict[int, PhasePeaks]:
        """The known steps' peaks per phase, as the search takes them (reserved ones where ``reserved``)."""
        return {size: peaks[reserved] for size, peaks in self._peaks.items() if peaks is not None}

    def allocations(self, size: int) -> AllocationSequence | None:
        """The allocation sequence of a batch of ``size`` (replayed now if not kept); ``None`` where it failed."""
        if size in self._sequences:
            self._sequences.move_to_end(size)
            return self._sequences[size]
        if size in self._peaks and self._peaks[size] is None:
            return None
        self._keep(size, self._replay(size))
        return self._sequences.get(size)

    def _replay(self, size: int) -> ReplayedStep | None:
        replays = self._replays
        if replays.out_of_time():
            self.failures.append(BUDGET_RAN_OUT)
            return None
        self.replays += 1
        result = replays.replay(BatchSizeChange(size))
        if isinstance(result, ReplayedStep):
            return result
        reason = BUDGET_RAN_OUT if replays.out_of_time() else f"the replay of batch size {size} failed: {result.reason}"
        self.failures.append(reason)
        return None

    def peaks(self, reserved: bool) -> Callable[[int], PhasePeaks | None]:
        """The search's peak function: a batch's peak per phase (reserved ones where ``reserved``)."""

        def peak_bytes(size: int) -> PhasePeaks | None:
            if size not in self._peaks:
                self._keep(size, self._replay(size))
            peaks = self._peaks[size]
            return None if peaks is None else peaks[reserved]

        return peak_bytes


def _served_row(
    steps: _Steps,
    name: str,
    capacity: tuple[int, int],
    seeds: tuple[int | None, int | None],
    settings: tuple[AllocatorSettings, AllocatorSettings],
    unseen_bytes: Mapping[Phase, int] | None,
    start: int,
) -> FitRow | None:
    """One GPU's row: the largest batch served with the run's settings and with expandable ones.

    ``capacity``: the card's memory and the bytes the allocator may hold there; ``seeds`` and ``settings``: the
    run's, then expandable segments'; ``start``: the run's batch (where ``unseen_bytes`` were measured). ``None``
    where a replay it needed failed (or a seed's search did).
    """
    (capacity_bytes, served_bytes), (seed, wide_seed), (run, expandable) = capacity, seeds, settings
    if seed is None:
        return None
    largest = largest_served(steps.allocations, run, served_bytes, seed, unseen_bytes, run_batch=start)
    if largest is None:
        return None
    wider: int | None = largest
    if run != expandable:  # from the run's answer up to where the tensors alone outgrow the card
        ceiling = None if wide_seed is None else wide_seed + 1
        wider = largest_served(
            steps.allocations, expandable, served_bytes, largest, unseen_bytes, ceiling=ceiling, run_batch=start
        )
    return _served_fit_row(name, capacity_bytes, largest, wider, run)


def largest_served(
    allocations: Callable[[int], AllocationSequence | None],
    settings: AllocatorSettings,
    capacity_bytes: int,
    guess: int,
    unseen_bytes: Mapping[Phase, int] | None = None,
    limit: int = MAX_BATCH_SIZE,
    ceiling: int | None = None,
    run_batch: int | None = None,
    memo: ServingMemo | None = None,
) -> int | None:
    """The largest batch from 1 to ``limit`` whose step the simulated allocator serves at ``capacity_bytes``.

    0 when a batch of 1 is not served; ``None`` when a replay it needed failed. Strides away from ``guess``
    (doubling) until the answer is bracketed, then bisects: a right guess costs its own check and the next batch's.
    ``ceiling``: a batch above ``guess`` likely not served; checked first where ``guess`` is served, it brackets
    the answer at once (striding resumes above it where it is served). ``run_batch``: the batch ``unseen_bytes``
    were measured at (they grow in proportion above it, :func:`unseen_at`). ``memo``: the search's servings (a
    batch served or not there already is not simulated again; default: this search's own).
    """
    servings = ServingMemo() if memo is None else memo

    def served(size: int) -> bool | None:
        sequence = allocations(size)
        if sequence is None:
            return None
        unseen = unseen_at(unseen_bytes or {}, run_batch, size)
        return servings.serve(size, sequence, settings, capacity_bytes, unseen).served

    guess = min(max(guess, 1), limit)
    fits = served(guess)
    if fits is None:
        return None
    stride = 1
    if fits:  # stride up from the guess (or a ceiling served) until a batch is not served
        low, above = guess, None
        if ceiling is not None and guess + 1 < ceiling <= limit:
            fits = served(ceiling)
            if fits is None:
                return None
            low, above = (ceiling, None) if fits else (guess, ceiling)
        while above is None:
            if low >= limit:
                return limit
            probe = min(low + stride, limit)
            fits = served(probe)
            if fits is None:
                return None
            if fits:
                low, stride = probe, stride * 2
            else:
                above = probe
        high = above
    else:  # stride down until one is
        high = guess
        while True:
            if high <= 1:
                return 0
            low = max(high - stride, 1)
            fits = served(low)
            if fits is None:
                return None
            if fits:
                break
            high, stride = low, stride * 2
    while high - low > 1:
        middle = (low + high) // 2
        fits = served(middle)
        if fits is None:
            return None
        low, high = (middle, high) if fits else (low, middle)
    return low


def phase_peaks(step: ReplayedStep, reserved: bool = False) -> PhasePeaks:
    """A replayed step's peak per phase, bytes, in step order (0 for a phase the step did not reach).

    ``reserved``: the simulated allocator's reserved peak where the phase has one, else its tensor peak.
    """

    def peak(phase: Phase) -> int:
        if phase not in step.phases:
            return 0
        replayed = step.phases[phase]
        return replayed.reserved_bytes if reserved and replayed.reserved_bytes is not None else replayed.peak_bytes

    return tuple(peak(phase) for phase in Phase)
