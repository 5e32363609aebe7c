"""Expandable segments can serve fewer batches than the default allocator near the card's memory, and the fit
table's row says why where they do."""

from __future__ import annotations

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.fit_table import EXPANDABLE_FEWER, _served_fit_row
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import AllocationSequence, Phase
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
    assert row.note == f"with expandable_segments:True 126 fewer: {EXPANDABLE_FEWER}"
    assert "20 MiB pages" in EXPANDABLE_FEWER
    assert fit_assumption([row]).endswith(f" RTX 3060 (12 GB): {row.note}.")
    gaps = _served_fit_row("x", 1, 336, 300, AllocatorSettings(), note="served to 336; 337-341 not served")
    assert gaps.note == f"served to 336; 337-341 not served; with expandable_segments:True 36 fewer: {EXPANDABLE_FEWER}"
    assert _served_fit_row("x", 1, 336, 342, AllocatorSettings()).note is None
    assert _served_fit_row("x", 1, 336, 336, AllocatorSettings()).note is None
