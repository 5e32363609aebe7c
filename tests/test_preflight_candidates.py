"""The changes preflight tries as remedies: freed gradients only where Lightning zeroes them."""

from __future__ import annotations

import pytest
from advice_summaries import healthy_setup

from lightning_vram.advice.preflight import candidate_changes
from lightning_vram.records import BatchSizeChange, FreeGradientsChange, PrecisionChange, TrainingSetup


def test_full_precision_tries_mixed_precision_freed_gradients_and_half_the_batch() -> None:
    changes = candidate_changes("32-true", 64, (9, 0), healthy_setup().lightning_zeroes_gradients)
    assert [type(change) for change in changes] == [PrecisionChange, FreeGradientsChange, BatchSizeChange]
    assert changes[-1] == BatchSizeChange(32)


@pytest.mark.parametrize(
    "setup",
    [healthy_setup(own_zero_grad=True), healthy_setup(automatic_optimization=False)],
    ids=["own-optimizer-zero-grad", "manual-optimization"],
)
def test_a_step_that_zeroes_its_own_gradients_is_not_offered_freed_gradients(setup: TrainingSetup) -> None:
    # Its gradients may be kept across batches (its own accumulation): a callback freeing them at batch start would
    # discard them, as the stale-gradients rule holds.
    changes = candidate_changes(setup.precision, 64, (9, 0), setup.lightning_zeroes_gradients)
    assert FreeGradientsChange() not in changes
    assert BatchSizeChange(32) in changes
