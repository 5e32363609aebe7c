"""A plan's first fitting row applied: the README's quickstart trained as the row says on 2 gloo ranks (DDP on the
CPU), each rank's measured phase peaks and counted parts within 5% of the row's per-rank prediction (the table is
printed: run with -s)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from preloaded_python import run_script

from lightning_vram.plan import plan

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from quickstart import SmallCNN

HANG = 900
"""Seconds a run may take: far more than a loaded 2-core machine needs, so only a hang reaches it."""
TOLERANCE = 0.05
BATCH = 64

pytestmark = [pytest.mark.distributed, pytest.mark.replay]


def test_the_first_fitting_row_trains_within_5_percent_of_its_prediction(tmp_path: Path) -> None:
    batch = (torch.zeros(BATCH, 3, 32, 32), torch.zeros(BATCH, dtype=torch.int64))
    result = plan(
        SmallCNN(),
        batch,
        gpus=["T4"],
        world_sizes=(2,),
        strategies=("ddp",),
        precisions=("32-true",),
        checkpointing=(False,),
    )
    row = next(row for row in result.rows if row.fits)
    assert (row.gpus, row.strategy, row.micro_batch, row.accumulation) == (2, "ddp", BATCH, 1)
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    script = Path(__file__).parent / "plan_applied_train.py"
    arguments = [str(tmp_path), str(row.gpus), str(row.micro_batch), str(row.accumulation), row.precision]
    ran = run_script(script, *arguments, timeout=HANG, env=environment)
    assert ran.returncode == 0, ran.stderr[-3000:]
    predicted_phases, predicted_parts = dict(row.phases), dict(row.parts)
    peak_phase = max(predicted_phases, key=predicted_phases.__getitem__)
    lines = [f"{'rank':>4} {'phase':<9} {'part':<15} {'measured':>10} {'predicted':>10} {'error':>8}"]
    compared: list[tuple[int, str, str, int, int]] = []
    for rank in range(row.gpus):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())["phases"]
        assert set(measured) == set(predicted_phases)
        for phase, figures in measured.items():
            compared.append((rank, phase, "peak", figures["peak"], predicted_phases[phase]))
        for part, predicted in predicted_parts.items():
            compared.append((rank, peak_phase, part, measured[peak_phase]["parts"][part], predicted))
    for rank, phase, part, measured_bytes, predicted in compared:
        error = abs(predicted - measured_bytes) / measured_bytes if measured_bytes else float(predicted != 0)
        lines.append(f"{rank:>4} {phase:<9} {part:<15} {measured_bytes:>10} {predicted:>10} {error:>8.4%}")
    print(
        f"\n{row.strategy} x{row.gpus}, {row.precision}, micro-batch {row.micro_batch}: measured and predicted (bytes)"
    )
    print("\n".join(lines))
    for rank, phase, part, measured_bytes, predicted in compared:
        assert predicted == pytest.approx(measured_bytes, rel=TOLERANCE, abs=0), (rank, phase, part)
