"""The ranks' one preflight gather before step 0, in one process: what this rank sends, what it keeps, what it warns.

The other rank is a gather that answers with its row (fits, needed, available, peak; NaN where skipped), so the exact
numbers each rank sends and the warning built from the agreed rows are checked without starting processes
(tests/test_preflight_ranks.py runs two gloo ranks).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from models import Classifier, linear_net
from sessions import train_steps
from test_session_contract import gone

from lightning_vram import VramMonitorWarning, VramSession
from lightning_vram.records import RankPreflight
from lightning_vram.session.assembly import Gather
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe
from lightning_vram.units import format_bytes

pytestmark = pytest.mark.replay  # preflight replays the first step

ROOMY = 8 * 1024**3
"""Free bytes on this rank's scripted device: its first step fits."""


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator))] * count


def run(free_bytes: int, gather: Gather, preflight: bool = True) -> tuple[VramSession, list[str]]:
    """Three steps of rank 0 of 2 on a scripted device with ``free_bytes`` free; the monitor's warnings."""
    model = Classifier(linear_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], free_bytes=free_bytes)
    session = VramSession(
        probe=probe, preflight=preflight, log_every_n_steps=100, attribution_start_step=100, console_summary=False
    )
    session.start(model, [optimizer], rank=0, world_size=2, gather=gather)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_steps(session, model, optimizer, batches(3), steps=3)
        session.finish(gather_ranks=False)
    return session, [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]


def test_each_rank_sends_its_verdict_once_before_step_0_and_warns_for_the_rank_that_does_not_fit() -> None:
    sent: list[list[float]] = []
    other = [0.0, 9_000_000.0, 1_000_000.0, 9_000_000.0]  # rank 1: needs 9,000,000 B, has 1,000,000 B

    def gather(values: list[float]) -> list[list[float]]:
        sent.append(values)
        return [values, other]

    session, messages = run(ROOMY, gather)
    verdict = session.preflight_verdict
    assert verdict is not None and verdict.fits
    needed = verdict.needed_bytes
    assert sent == [[1.0, float(needed), float(ROOMY), float(needed)]]  # one gather in three steps
    assert session.preflight_ranks == (
        RankPreflight(0, True, needed, ROOMY, needed),
        RankPreflight(1, False, 9_000_000, 1_000_000, 9_000_000),
    )
    assert messages == [
        "VramSession: preflight on 2 ranks before step 0: 1 of 2 ranks predicted to run out of memory: rank 1 needs"
        f" {format_bytes(9_000_000)} more, {format_bytes(1_000_000)} available ({format_bytes(8_000_000)} short)."
        " Predicted to fit: rank 0."
    ]


def test_a_skipped_rank_is_named_and_ranks_that_all_fit_say_nothing() -> None:
    skipped = [math.nan] * 4
    session, messages = run(ROOMY, lambda values: [values, skipped])
    assert session.preflight_ranks[1] == RankPreflight(1, None)
    assert messages == []


def test_a_failed_gather_warns_once_and_this_rank_keeps_its_own_verdict() -> None:
    session, messages = run(1024, gone)
    verdict = session.preflight_verdict
    assert verdict is not None and not verdict.fits
    assert session.preflight_ranks == (RankPreflight(0, False, verdict.needed_bytes, 1024, verdict.needed_bytes),)
    assert len(messages) == 2
    assert "the exchange between ranks failed with RuntimeError: Connection closed" in messages[0]
    assert messages[1].startswith("VramSession: the first training step is predicted to run out of memory")


def test_with_preflight_off_no_rank_gathers_before_step_0() -> None:
    sent: list[list[float]] = []

    def gather(values: list[float]) -> list[list[float]]:
        sent.append(values)
        return [values, values]

    session, _ = run(ROOMY, gather, preflight=False)
    assert sent == [] and session.preflight_ranks == ()
