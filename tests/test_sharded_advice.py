"""A live DeepSpeed ZeRO-1/2 run's advice, replayed rank by rank (issue 26: simulated where 0.11.0 said "skipped").

Each of 2 gloo ranks replays the unsharded module's step on its own and predicts its share by ZeRO's arithmetic
(``predict_rank``); its sampled step is the baseline, within 5% per part and phase, so the advice a change applies
to is simulated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sharded_runs import run_zero
from test_distributed import run_sharded

pytestmark = [pytest.mark.distributed, pytest.mark.replay]


@pytest.mark.parametrize("stage", [1, 2])
def test_each_zero_rank_replays_its_own_step_and_simulates_its_advice(tmp_path: Path, stage: int) -> None:
    ranks = run_zero(tmp_path, stage)
    for rank, record in enumerate(ranks):
        assert record["skipped"] is None, (rank, record["skipped"])
        assert record["notes"][-1].startswith(f"deepspeed_stage_{stage} x2: arithmetic on the single-process replay")
        parts = {(phase, part): (measured, predicted) for phase, part, measured, predicted in record["match"]}
        assert {phase for phase, _ in parts} == {"forward", "backward", "optimizer"}
        for (phase, part), (measured, predicted) in parts.items():
            print(f"rank {rank} {phase:9} {part:16} measured {measured:>9} predicted {predicted:>9}")
            assert predicted == pytest.approx(measured, rel=0.05, abs=0), (rank, phase, part)
            if part != "live peak":  # the counted parts are ZeRO's arithmetic to the byte on this model
                assert predicted == measured, (rank, phase, part)
        basis, saving = record["advice"]["inplace-activations"]
        assert basis == "simulated" and saving > 0
    # Each rank's partition gradients at the step are its own (rank 0's partition cuts through a larger parameter).
    at_step = [
        dict(((p, part), m) for p, part, m, _ in record["match"])[("optimizer", "gradients")] for record in ranks
    ]
    assert at_step[0] != at_step[1]


def test_lightning_deepspeed_stage_2_ranks_simulate_their_advice(tmp_path: Path) -> None:
    # Lightning's DeepSpeedStrategy (its CUDA checks lifted, tests/sharded_train.py) with the ZeRO settings it writes:
    # the callback hands the ZeRO optimizer to the session, and each rank's advice is simulated on its own replay.
    records = run_sharded(tmp_path, "deepspeed_stage_2", "mlp")
    for record in records:
        assert record["skipped"] is None
        assert record["advice"]["inplace-activations"] == "simulated"
    report = json.loads((tmp_path / "vram_report.json").read_text())
    assert report["simulation"]["skipped"] is None
    assert {item["id"]: item["saving_basis"] for item in report["advice"]}["inplace-activations"] == "simulated"
