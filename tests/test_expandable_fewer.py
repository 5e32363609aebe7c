"""Expandable segments can serve fewer batches than the default allocator near the card's memory, and the fit
table's row says why where they do."""

from __future__ import annotations

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.fit_table import _served_fit_row
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import AllocationSequence, FitRow, Phase, PhasePeak, Prediction, ReplayedStep, SavingBasis
from lightning_vram.records.advice import EXPANDABLE_FEWER, EXPANDABLE_MORE
from lightning_vram.render.text import fit_assumption

MIB = 1024**2

STEP: AllocationSequence = (
    Phase.FORWARD,
    ("malloc", 1, 12 * MIB, 0),  # default: a 12 MiB segment; expandable: the first 20 MiB page
    ("malloc", 2, 4 * MIB, 0),  # default: a 20 MiB segment; expandable: the same page, after the 12 MiB
    ("free", 1, 0, 0),  # default: a whole cached segment; expandable: 12 MiB of a page the 4 MiB still hold
    ("malloc", 3, 30 * MIB, 0),
)


def test_a_page_shared_with_a_live_tensor_stays_mapped_where_the_default_frees_its_segment() -> None:
    default, expandable = AllocatorSettings(), AllocatorSettings(expandable_segments=True)
    # The default releases the cached 12 MiB segment and asks for 30 MiB: 20 + 30 = 50 MiB.
    assert serve(STEP, default, 50 * MIB).served
    short = serve(STEP, expandable, 56 * MIB).shortfall
    # Expandable: the page stays mapped (12 MiB free on it), the segment grows by two 20 MiB pages: 60 MiB.
    assert short is not None and (short.allocated_bytes, short.reserved_bytes) == (4 * MIB, 20 * MIB)
    assert serve(STEP, expandable, 60 * MIB).served


def test_a_row_whose_expandable_batch_is_below_its_default_one_says_why() -> None:
    row = _served_fit_row("RTX 3060 (12 GB)", 11_811_160_064, 24_234, 24_108, AllocatorSettings())
    assert row.note is None and "20 MiB pages" in EXPANDABLE_FEWER
    assert fit_assumption([row]).endswith(
        f" With expandable_segments:True fewer on RTX 3060 (12 GB) (24,108 against 24,234): {EXPANDABLE_FEWER}."
    )
    gaps = _served_fit_row("x", 1, 336, 300, AllocatorSettings(), note="served to 336; 337-341 not served")
    assert gaps.note == "served to 336; 337-341 not served"
    assert _served_fit_row("x", 1, 336, 342, AllocatorSettings()).note is None


# The new user's table: four GPUs with fewer batches under expandable segments, two with more (the figures seen).
TABLE = (
    ("RTX 3060", 24_234, 24_108),
    ("RTX 4090", 48_561, 48_420),
    ("A100 40GB", 1_771, 1_768),
    ("A100 80GB", 3_556, 3_564),
    ("H100 80GB", 3_560, 3_552),
    ("H200", 6_343, 6_356),
)


def test_each_reason_is_said_once_naming_its_gpus_and_more_is_explained() -> None:
    rows = [
        FitRow(name, 1 << 30, run, SavingBasis.SIMULATED, allocator="", expandable_max_batch_size=wide)
        for name, run, wide in TABLE
    ]
    assert fit_assumption(rows).count(EXPANDABLE_FEWER) == 1
    assert fit_assumption(rows).count(EXPANDABLE_MORE) == 1
    step = ReplayedStep(
        "cuda", "32-true", 8, {Phase.FORWARD: PhasePeak(0, Phase.FORWARD, 1 << 20, None, None)}, (), 0, 0.0
    )
    lines = str(Prediction(step, tuple(rows), None)).splitlines()
    fewer = [line for line in lines if EXPANDABLE_FEWER in line]
    more = [line for line in lines if EXPANDABLE_MORE in line]
    assert fewer == [
        "  with expandable_segments:True fewer on RTX 3060 (24,108 against 24,234), RTX 4090 (48,420 against 48,561),"
        f" A100 40GB (1,768 against 1,771), H100 80GB (3,552 against 3,560): {EXPANDABLE_FEWER}"
    ]
    assert more == [
        "  with expandable_segments:True more on A100 80GB (3,564 against 3,556), H200 (6,356 against 6,343):"
        f" {EXPANDABLE_MORE}"
    ]
