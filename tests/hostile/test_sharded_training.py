"""A DeepSpeed ZeRO-2 run trains the same with the monitor replaying each rank's step and without it."""

from __future__ import annotations

from pathlib import Path

import pytest
from sharded_runs import WORLD, run_zero, training

pytestmark = pytest.mark.distributed


def test_zero2_ranks_train_the_same_with_and_without_their_replays(tmp_path: Path) -> None:
    # Each rank replays the unsharded module's step (a fake twin, its own warm-up step, an optimizer of the user's
    # class built beside ZeRO's) inside training: the losses, the parameters, the user's optimizer's state, ZeRO's
    # fp32 master partition and the RNG's state come out as without the monitor.
    with_monitor, without = tmp_path / "with", tmp_path / "without"
    with_monitor.mkdir(), without.mkdir()
    ranks = run_zero(with_monitor, 2)
    assert all(record["skipped"] is None for record in ranks)  # every rank replayed
    run_zero(without, 2, "no-monitor")
    for rank in range(WORLD):
        trained = training(with_monitor, rank)
        assert trained == training(without, rank)
        assert len(trained["losses"]) == 3
