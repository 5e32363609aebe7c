"""The fit table solved on a checked line: the same rows as an exhaustive search, in a few replays; and what a run
says when its replay budget cuts the table or a change short."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from models import OPTIMIZERS, Classifier, linear_net
from replay_models import ARCHITECTURES, Architecture, mlp
from simulations import GIB, simulated
from test_simulation_report import report_with
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram.advice.savings import resolve_saving
from lightning_vram.codec import report_from_dict
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.search import (
    LINE_CHECKS,
    MAX_BATCH_SIZE,
    largest_batch_that_fits,
    largest_batches_that_fit,
)
from lightning_vram.prediction.replay.simulation import NOT_REPLAYED
from lightning_vram.records import (
    BatchSizeChange,
    FitRow,
    FreeGradientsChange,
    ReplayedStep,
    ReplaySkipped,
    SavingBasis,
    Simulation,
    StepChange,
)
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown

# The fit table, solved in a few replays.
pytestmark = pytest.mark.replay

GROWTH = (1.3, 2.0, 5.0, 20.0, 70.0)
"""Capacities of the test's GPUs as multiples of the run's own replayed peak: batches from about 1.5x the run's to
a few thousand, where rounding, phase changes and kernel choices would show."""


def reference_rows(peak: Callable[[int], int], rows: tuple[FitRow, ...], context: int) -> None:
    """Each row is the largest batch that fits, as any exhaustive search finds it on a peak that grows with the
    batch: its peak within the budget and the next batch's over it (or the search's bound)."""
    for row in rows:
        budget = int(row.capacity_bytes * (1 - BATCH_SAFETY_MARGIN)) - context
        assert peak(row.max_batch_size) <= budget, row
        if row.at_least:
            assert row.max_batch_size == MAX_BATCH_SIZE
        else:
            assert peak(row.max_batch_size + 1) > budget, row


def wide_mlp(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 512, generator=generator), torch.randint(0, 10, (samples,)))


MODELS = {
    # 512 wide: a sample's bytes outgrow the allocator's 512-byte rounding; at 64 wide the rounding is the slope.
    "mlp": Architecture(lambda: Classifier(mlp(width=512), OPTIMIZERS["adam"]), wide_mlp, 16),
    "mlp-64": ARCHITECTURES["mlp"],
    "resnet": ARCHITECTURES["resnet"],
    "encoder": ARCHITECTURES["encoder"],
    "gpt2": ARCHITECTURES["gpt2"],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_solved_table_equals_an_exhaustive_search_in_a_few_replays(name: str) -> None:
    architecture = MODELS[name]
    torch.manual_seed(0)
    module = architecture.build()
    batch = next(iter(DataLoader(architecture.data(architecture.batch_size), batch_size=architecture.batch_size)))
    peaks: dict[int, int] = {}
    predictor = Predictor(module, None, batch, warm_up=True)

    def peak(size: int) -> int:
        if size not in peaks:
            replayed = predictor.batch_size(size)
            assert isinstance(replayed, ReplayedStep)
            peaks[size] = replayed.peak.peak_bytes
        return peaks[size]

    own = peak(architecture.batch_size)
    gpus = tuple((f"{growth}x", int(own * growth / (1 - BATCH_SAFETY_MARGIN))) for growth in GROWTH)
    search = Predictor(module, None, batch, warm_up=True).fit_table(0, gpus=gpus)
    assert search.missing is None and len(search.found) == len(gpus)
    assert all(row.basis is SavingBasis.SIMULATED for row in search.found)
    sizes = [row.max_batch_size for row in search.found]
    assert sizes == sorted(sizes) and sizes[0] >= architecture.batch_size and sizes[-1] > 20 * architecture.batch_size
    reference_rows(peak, search.found, 0)
    # Two replays for the line, a few to check it, a pair where a row's boundary is too close to call: below the
    # dozen or more per row a bisection from the run's batch spends.
    # Where a sample is a few allocator blocks (64 wide), no line is clearer than the rounding: rows are replayed.
    bound = 5 * len(gpus) if name == "mlp-64" else 2 + LINE_CHECKS + 2 * len(gpus)
    assert search.replays <= bound, search.replays


def test_a_line_that_holds_settles_every_budget_in_three_replays() -> None:
    calls: list[int] = []

    def peak(size: int) -> int:
        calls.append(size)
        return 300 * 1024**2 + 3 * 1024**2 * size + 512 * (size % 7 == 0)  # affine, within allocator rounding

    budgets = [1 * 1024**3, 5 * 1024**3, 20 * 1024**3, 70 * 1024**3]
    sizes, replays = largest_batches_that_fit(peak, budgets, start=16)
    assert replays == len(calls) == len(set(calls)) <= 4
    expected = [largest_batch_that_fits(peak, budget, start=size) for budget, size in zip(budgets, sizes, strict=True)]
    assert list(sizes) == expected and sizes[-1] > 20_000


def test_a_peak_that_bends_is_searched_where_the_line_disagrees() -> None:
    def peak(size: int) -> int:  # flat (the optimizer phase) until the activations overtake it, then steeper
        return max(50_000_000, 10_000_000 + 200_000 * size) + 4096 * (size // 1000)

    budgets = [60_000_000, 500_000_000, 2_000_000_000]
    sizes, replays = largest_batches_that_fit(peak, budgets, start=4)
    for budget, size in zip(budgets, sizes, strict=True):
        assert size is not None and peak(size) <= budget < peak(size + 1)
    assert replays < 3 * 2 * len(budgets)


def test_a_line_per_phase_settles_a_peak_that_moves_between_phases_in_the_replays_of_a_straight_line() -> None:
    def phases(size: int) -> tuple[int, int, int]:
        """Forward overtaken by backward at batch 64, both over a flat optimizer step from about 40: in blocks."""

        def blocks(value: int) -> int:
            return -(-value // 512) * 512

        return (
            blocks(200_000_000 + 3_000_000 * size),
            blocks(100_000_000 + 4_600_777 * size),
            blocks(400_000_000),
        )

    budgets = [450_000_000, 900_000_000, 3_000_000_000, 12_000_000_000, 40_000_000_000]
    by_phase, phase_replays = largest_batches_that_fit(phases, budgets, start=8)
    step_peak, step_replays = largest_batches_that_fit(lambda size: max(phases(size)), budgets, start=8)
    expected = tuple(largest_batch_that_fits(lambda size: max(phases(size)), budget, start=8) for budget in budgets)
    assert by_phase == step_peak == expected
    assert phase_replays <= 4 < step_replays  # the line of the step's peak bends at each kink: 16 replays


def test_a_failed_replay_keeps_the_rows_already_settled() -> None:
    def peak(size: int) -> int | None:
        return None if size > 5000 else 1_000_000 * size  # the replays of large batches fail

    sizes, _ = largest_batches_that_fit(peak, [100_500_000, 10_000_000_000], start=8)
    assert sizes == (100, None)


class Scripted:
    """A host clock that moves on ``step`` seconds each time the search reads it."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_budget_that_runs_out_keeps_the_rows_found_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    module = Classifier(linear_net(), OPTIMIZERS["adam"])
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    replayed: list[int] = []
    real = Predictor.replay

    def counted(predictor: Predictor, change: StepChange | None = None) -> ReplayedStep | ReplaySkipped:
        assert isinstance(change, BatchSizeChange)
        replayed.append(change.batch_size)
        return real(predictor, change)

    own = Predictor(module, None, batch, warm_up=True).baseline()
    assert isinstance(own, ReplayedStep)
    monkeypatch.setattr(Predictor, "replay", counted)
    # The first GPU's boundary sits on the line's answer (confirmed by replays); the last is far beyond the check.
    gpus = (("small", int(own.peak.peak_bytes * 1.5 / (1 - BATCH_SAFETY_MARGIN))), ("huge", 1 << 50))
    complete = Predictor(module, None, batch, warm_up=True).fit_table(0, gpus=gpus)
    assert complete.missing is None and len(complete.found) == 2
    needed = len(replayed)
    replayed.clear()
    clock = Scripted(step=1.0)  # each read of the clock takes a second: two a replay (the check, its deadline)
    cut = Predictor(module, None, batch, warm_up=True, budget_seconds=7.0, clock=clock).fit_table(0, gpus=gpus)
    assert len(replayed) < needed
    assert cut.missing is not None and cut.missing.startswith("the replay budget ran out")
    assert len(cut.found) < 2 and "no row for" in cut.missing
    assert all(row in complete.found for row in cut.found)  # what was found before the end is kept as found


def test_a_change_cut_by_the_budget_reads_not_replayed_and_the_fit_note_is_reported() -> None:
    module = Classifier(linear_net(), OPTIMIZERS["adam"])
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    # Read at the start, before the baseline, before the first change and its replay (which then has 100 ns
    # left, and stops at its first op), after it; the second change finds the budget spent.
    ticks: Iterator[float] = iter([0.0, 0.0, 0.0, 10.0 - 1e-7, 100.0])
    simulation = Predictor(
        module, [torch.optim.Adam(module.parameters())], batch, budget_seconds=10.0, clock=lambda: next(ticks, 100.0)
    ).simulate([FreeGradientsChange(), BatchSizeChange(16)])
    assert simulation.baseline is not None
    reasons = [variant.discarded for variant in simulation.variants]
    cut = f"{NOT_REPLAYED}: the replay budget ran out"
    assert all(reason is not None and reason.startswith(cut) for reason in reasons), reasons
    # The rules read it as untried (modelled), never as a change whose replay raised.
    assert resolve_saving(simulation, FreeGradientsChange(), None) is None

    noted = replace(simulation, fit=(), fit_note="the replay budget ran out; no row for T4 (16 GiB)")
    back = simulation_from_dict(simulation_to_dict(noted))
    assert isinstance(back, Simulation) and back.fit_note == noted.fit_note
    old = simulation_to_dict(simulation)
    assert old is not None
    del old["fit_note"]  # a report written before the field existed still reads
    assert (read := simulation_from_dict(old)) is not None and read.fit_note is None


def test_a_cut_fit_table_says_why_in_every_report_form() -> None:
    note = "the replay budget ran out; no row for A100 40GB, A100 80GB / H100 80GB, H200 (141 GiB)"
    report = report_with(replace(simulated(fit=(FitRow("T4 (16 GiB)", 16 * GIB, 60),)), fit_note=note))
    assert report.to_dict()["simulation"]["fit_note"] == note
    read = report_from_dict(json.loads(json.dumps(report.to_dict()))).simulation
    assert read is not None and read.fit_note == note
    for shown in (markdown(report), render_html(report)):
        assert "Largest batch per GPU: the replay budget ran out; no row for A100 40GB" in shown
