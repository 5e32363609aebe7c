"""Unseen bytes (measured beyond the replay on the sampled step) are carried in proportion to the batch above the
run's: a workspace that grows with the batch (cuDNN's) is never under-carried at a larger batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_fits import SETTINGS, _predictor

from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.replay.calibration import calibrate
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import Phase, ReplayedStep

pytestmark = pytest.mark.replay

MIB = 1024**2
PER_SAMPLE = 512 * 1024
"""The scripted workspace: half a MiB per sample in forward and backward (a convolution's, sized by its input)."""


def _workspace(batch: int) -> dict[Phase, int]:
    return {Phase.FORWARD: PER_SAMPLE * batch, Phase.BACKWARD: PER_SAMPLE * batch, Phase.OPTIMIZER: 0}


def test_a_workspace_that_grows_with_the_batch_is_carried_in_proportion_into_replays_and_the_fit_table() -> None:
    predictor = _predictor("conv-batchnorm", SETTINGS["defaults"])
    with round_of_replays():
        raw = predictor.baseline()
        assert isinstance(raw, ReplayedStep) and raw.batch_size == 32 and raw.allocations is not None
        # The scripted allocator: the replay's peaks plus the workspace at the run's batch (16 MiB).
        measured = {
            phase: replace(peak, peak_bytes=peak.peak_bytes + _workspace(32)[phase], reserved_bytes=None)
            for phase, peak in raw.phases.items()
        }
        predictor.carried = calibrate(raw, measured, 1)
        assert predictor.unseen_bytes == _workspace(32)
        bare = {size: predictor.batch_size(size) for size in (16, 96)}
        predictor.carried = None
        plain = {size: predictor.batch_size(size) for size in (16, 96)}
    for size in (16, 96):
        carried, replayed = bare[size], plain[size]
        assert isinstance(carried, ReplayedStep) and isinstance(replayed, ReplayedStep)
        added = {phase: carried.phases[phase].peak_bytes - replayed.phases[phase].peak_bytes for phase in Phase}
        # Below the run's batch as measured (16 MiB); at three times it, three times as much (48 MiB).
        assert added == _workspace(max(size, 32))
        reserved = carried.phases[Phase.FORWARD].reserved_bytes
        assert reserved is not None and reserved >= carried.phases[Phase.FORWARD].peak_bytes
    assert "(scaled to batch 96 from the run's 32)" in bare[96].notes[-1]

    # The fit table at a small card: its batch must be served with the workspace that batch really takes.
    context = 64 * MIB
    capacity = context + 6 * max(peak.reserved_bytes or 0 for peak in raw.phases.values())
    predictor.carried = calibrate(raw, measured, 1)
    with round_of_replays():
        search = predictor.fit_table(context, gpus=[("small", capacity)])
        (row,) = search.found
        largest = predictor.batch_size(row.max_batch_size)
    assert isinstance(largest, ReplayedStep) and largest.allocations is not None
    assert row.max_batch_size > 32
    truth = serve(largest.allocations, SETTINGS["defaults"], capacity - context, _workspace(row.max_batch_size))
    assert truth.served, truth.shortfall
