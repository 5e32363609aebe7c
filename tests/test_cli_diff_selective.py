"""``lightning-vram diff`` where run B checkpointed selectively: never A's whole-unit prediction taken for B's plan.

Run A trains a transformer encoder (plain torch, 4 ``nn.TransformerEncoderLayer``) on the CPU; its replay simulates
checkpointing 3 of its layers whole. Run B applies the same 3 layers as a memory budget's *selective* plan, as
printed (``SelectivelyCheckpointed``: the outputs of matrix products and attention kept from forward): B's report
records which units torch's selective checkpointing re-ran, and the diff says that A's prediction is of another plan,
with no percentage and no step-time verdict. Where A's report holds the selective plan's own prediction, B is checked
against that one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Classifier, loader, trainer
from test_checkpointing_same_model import apply_printed
from test_cli_diff_runs import diff_lines, prediction_line
from test_memory_budget import Encoder, token_classes

from lightning_vram import VramMonitor
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.codec import report_from_dict
from lightning_vram.records import CheckpointChange, CheckpointPlan
from lightning_vram.units import format_bytes

pytestmark = pytest.mark.replay  # run A's replay simulates the checkpointing plans B is checked against

LAYERS = tuple(f"network.encoder.layers.{index}" for index in range(3))
"""The encoder layers A's replay checkpoints in one of its plans, and B checkpoints selectively."""
RERUN = [[f"{name}.block"] for name in reversed(LAYERS)]
"""What B's backward re-ran: each wrapper's block, last layer first."""
WHOLE_LABEL = "checkpoint network.encoder.layers.0 to network.encoder.layers.2 (3 units)"


def run(root: Path, module: Classifier) -> dict[str, Any]:
    """Three steps of ``module`` at batch size 16 (sequences of 64 tokens) under the monitor; the report's JSON."""
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(module, loader(token_classes(6 * 16, 64), 16))
    data: dict[str, Any] = json.loads((root / "vram_report.json").read_text())
    return data


def whole_plan(data: dict[str, Any]) -> CheckpointPlan:
    """A's replayed plan checkpointing :data:`LAYERS` whole."""
    report = report_from_dict(data)
    assert report.simulation is not None
    (plan,) = [
        variant.change.plan
        for variant in report.simulation.variants
        if isinstance(variant.change, CheckpointChange) and variant.change.plan.units == tuple((n,) for n in LAYERS)
    ]
    return plan


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run A, and run B with A's 3-layer plan applied selectively, as a budget plan prints it."""
    torch.manual_seed(1)
    before = run(tmp_path_factory.mktemp("a"), Classifier(Encoder()))
    plan = replace(whole_plan(before), selective=LAYERS)
    _, code = checkpoint_snippet(plan)
    assert "SelectivelyCheckpointed(self.network.encoder.layers[index])" in code
    torch.manual_seed(1)
    applied = Classifier(Encoder())
    apply_printed(applied, plan, code)
    return before, run(tmp_path_factory.mktemp("b"), applied)


def checkpoint_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "network.encoder.layers" in line and not line.startswith("advice")]


def test_b_records_the_units_it_recomputed_selectively(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = runs
    assert after["recomputed_units"] == RERUN
    assert after["selective_units"] == [unit[0] for unit in RERUN]
    assert before["recomputed_units"] == [] and before["selective_units"] == []
    report = report_from_dict(after)
    assert report.selective_units == tuple(unit[0] for unit in RERUN)


def test_a_whole_unit_prediction_is_no_verdict_on_a_selective_run(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = runs
    lines = diff_lines(before, after, tmp_path, capsys)
    print("\n".join(lines))
    (whole,) = [entry for entry in before["simulation"]["variants"] if entry["change"] == WHOLE_LABEL]
    measured = after["peak"]["allocated_bytes"]
    assert checkpoint_lines(lines) == [
        f"A's replay predicted {format_bytes(whole['predicted_peak_bytes'])} for {WHOLE_LABEL}, every unit whole;"
        f" B checkpointed every unit selectively: another plan, no verdict (B measured {format_bytes(measured)})"
    ]
    assert not any(line.startswith("A's replay predicted") and "(diff " in line for line in lines)
    assert not any(line.startswith("step time (activation-checkpointing)") for line in lines)
    assert "  units recomputed in backward (activation checkpointing): 0 -> 3 (3 selectively)" in lines


def test_whole_units_recorded_get_the_whole_plans_verdict(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same recomputation recorded as whole units (or by a report before selective units were) is A's plan."""
    before, after = runs
    (whole,) = [entry for entry in before["simulation"]["variants"] if entry["change"] == WHOLE_LABEL]
    measured = after["peak"]["allocated_bytes"]
    unrecorded = {key: value for key, value in after.items() if key != "selective_units"}
    for changed in ({**after, "selective_units": []}, unrecorded):
        lines = diff_lines(before, changed, tmp_path, capsys)
        assert checkpoint_lines(lines) == [prediction_line(whole["predicted_peak_bytes"], WHOLE_LABEL, measured)]


def test_a_selective_prediction_in_a_is_checked_against_b(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A report whose replay tried the selective plan too: B is checked against that prediction only.

    The selective plan's entry is the whole plan's, its parameters naming the units checkpointed selectively.
    """
    before, after = runs
    variants = before["simulation"]["variants"]
    (whole,) = [entry for entry in variants if entry["change"] == WHOLE_LABEL]
    selective = {**whole, "parameters": {**whole["parameters"], "selective": list(LAYERS)}}
    with_selective = {**before, "simulation": {**before["simulation"], "variants": [*variants, selective]}}
    report = report_from_dict(with_selective)
    assert report.simulation is not None
    change = report.simulation.variants[-1].change
    assert isinstance(change, CheckpointChange) and change.plan.selective == LAYERS
    label = "checkpoint network.encoder.layers.0 to network.encoder.layers.2 (3 units, 3 selectively)"
    assert change.label == label
    lines = diff_lines(with_selective, after, tmp_path, capsys)
    measured = after["peak"]["allocated_bytes"]
    assert checkpoint_lines(lines) == [prediction_line(whole["predicted_peak_bytes"], label, measured)]


def test_units_no_plan_of_a_covers_are_said_to_have_no_prediction(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's trial: B checkpointed two units A's replay never simulated (a plan from ``predict``), and diff
    said nothing of them, the only predicted figure in sight an advice's."""
    before, after = runs
    unsimulated = {**after, "recomputed_units": [["network.head"], ["network.embed"]], "selective_units": []}
    lines = diff_lines(before, unsimulated, tmp_path, capsys)
    measured = after["peak"]["allocated_bytes"]
    assert (
        "B recomputed 2 unit(s) in backward that no checkpointing plan A's replay simulated: no prediction to check"
        f" (B measured {format_bytes(measured)})"
    ) in lines
    # Units a simulated plan has get that plan's verdict (whole) or "another plan" (selective), never this line.
    for units in (after, {**after, "selective_units": []}):
        assert not any(
            "no checkpointing plan A's replay simulated" in line for line in diff_lines(before, units, tmp_path, capsys)
        )


def test_a_run_not_replayed_says_so_beside_its_modelled_promise(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's trial: A's step was not replayed (its advice modelled, "about 62.0 MiB"), B applied it and saved
    47.5 MiB, and diff said "no checkpointing plan A's replay simulated"."""
    before, after = runs
    skipped = "the step reads a tensor's value"
    fell = before["peak"]["allocated_bytes"] - after["peak"]["allocated_bytes"]
    assert fell > 0
    (advice,) = [item for item in before["advice"] if item["id"] == "activation-checkpointing"]
    modelled = {**advice, "saving_basis": "modelled", "estimated_saving_bytes": 2 * fell}
    unreplayed = {
        **before,
        "simulation": {**before["simulation"], "skipped": skipped, "variants": []},
        "advice": [modelled if item is advice else item for item in before["advice"]],
    }
    lines = diff_lines(unreplayed, after, tmp_path, capsys)
    assert (
        f"B recomputed 3 unit(s) in backward; A's step was not replayed ({skipped}): no simulated prediction to check"
        f" (B measured {format_bytes(after['peak']['allocated_bytes'])}); A's modelled activation-checkpointing advice"
        f" promised about {format_bytes(2 * fell)}, the peak fell {format_bytes(fell)} (50.0% of it)"
    ) in lines
    assert not any("A's replay" in line for line in lines)
    risen = {**after, "peak": {**after["peak"], "allocated_bytes": before["peak"]["allocated_bytes"] + 1000}}
    lines = diff_lines(unreplayed, risen, tmp_path, capsys)
    assert any(
        line.endswith(f"promised about {format_bytes(2 * fell)}, the peak did not fall (B's is 1000 B above A's)")
        for line in lines
    ), lines
