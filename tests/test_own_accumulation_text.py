"""Where the run's own code accumulates (manual optimization, a plain or Fabric loop), the micro-batch that keeps the
global batch is said as that code's accumulation: Lightning refuses ``accumulate_grad_batches`` under manual
optimization (a MisconfigurationException at fit), and a loop has no such setting."""

from __future__ import annotations

import pytest
from advice_summaries import GIB, healthy_setup, healthy_summary, peak

from lightning_vram.advice.report import build_report
from lightning_vram.records import Breakdown, FitRow, Phase, TrainingLoop, TrainingSetup
from lightning_vram.records.advice_json import fit_row_from_dict, fit_row_to_dict
from lightning_vram.render.text import fit_assumption

OWN = "your code accumulating"


def test_a_row_kept_by_the_run_s_own_code_says_so_and_round_trips() -> None:
    row = FitRow("T4", 16, 90).keeping(384, 1, own_accumulation=True)
    assert row.accumulation_text == (
        "micro-batch 77, your code accumulating 5 per optimizer step, each loss divided by 5 (global batch 385, the"
        " run's 384)"
    )
    assert fit_row_from_dict(fit_row_to_dict(row), "fit[0]") == row
    assert "accumulate_grad_batches=" not in fit_assumption([row])
    lightning = FitRow("T4", 16, 90).keeping(384, 1)
    assert fit_row_from_dict(fit_row_to_dict(lightning), "fit[0]") == lightning
    assert "accumulate_grad_batches=5" in fit_assumption([lightning])


@pytest.mark.parametrize(
    ("setup", "lightning_setting"),
    [
        (healthy_setup(), True),
        (healthy_setup(automatic_optimization=False), False),
        (healthy_setup(loop=TrainingLoop.FABRIC), False),
        (healthy_setup(loop=TrainingLoop.PLAIN), False),
    ],
    ids=["automatic", "manual", "fabric", "plain"],
)
def test_the_report_s_fit_table_says_who_accumulates(setup: TrainingSetup, lightning_setting: bool) -> None:
    # 20 GiB at the backward peak, 15 GiB of it activations: the smaller GPUs of the table do not hold the batch.
    wide = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=GIB, activations=15 * GIB, other=2 * GIB)
    at_peak = peak(Phase.BACKWARD, 20 * GIB, wide)
    summary = healthy_summary(peak=at_peak, phases={Phase.BACKWARD: at_peak})
    report = build_report(summary, setup, top_modules=3, ranks=(), not_measured=())
    kept = [row.accumulation_text for row in report.fit if row.accumulation_text is not None]
    assert kept, [row.max_batch_size for row in report.fit]
    assert all(("accumulate_grad_batches=" in text) is lightning_setting for text in kept), kept
    assert all((OWN in text) is not lightning_setting for text in kept), kept
