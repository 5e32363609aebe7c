"""``lightning-vram diff`` where a checkpointed module runs more than once a step, and under gradient accumulation.

Run A trains a LightningModule (plain torch: three blocks of two ``nn.Linear``, one ``nn.Dropout`` called after the
first and the second) on the CPU; its replay simulates checkpointing ``block1``, ``block2``, ``block3`` and ``drop`` (4
units). Run B applies that plan as printed: backward recomputes the dropout once per call, and B's report lists
``drop.block`` twice. A new user's trial (a U-Net's one ``MaxPool2d``, a GRU's one ``Dropout``) read "no checkpointing
plan A's replay simulated" and, where A advised chunked-loss, a verdict on a chunked loss nobody applied: a unit called
twice is one unit of A's plan, and only the output layer recomputed once per chunk of the advice is the chunked loss.

Under ``accumulate_grad_batches=2`` the sampled step is a window's first micro-batch, which holds less than the
steady one the replay's figures are of. B's peak is measured on the window's stepping micro-batch, sampled too, and
set against A's steady prediction; a report whose peak is a first micro-batch's (written before the stepping one was
sampled) is set against A's prediction of a first micro-batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import dataset, loader, trainer
from test_checkpointing_same_model import apply_printed
from test_cli_diff_runs import diff_lines, prediction_line
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.advice.rules.chunked_loss import LOSS_CHUNKS
from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.records import CheckpointChange, CheckpointPlan
from lightning_vram.units import format_bytes

pytestmark = pytest.mark.replay  # run A's replay simulates the checkpointing plan B is checked against

PLAN_LABEL = "checkpoint block1, block2, block3 and drop (4 units)"
"""A's replayed plan with the dropout called twice among its units."""
ADVISED_LABEL = "checkpoint block1, block2 and block3 (3 units)"
"""A's advised plan under accumulation."""


def block(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.LeakyReLU(), nn.Linear(width, width), nn.LeakyReLU())


class TwiceDropped(pl.LightningModule):
    """Three blocks and a head, with one ``Dropout`` called after the first block and again after the second."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.block1, self.block2, self.block3 = block(width), block(width), block(width)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.block3(self.drop(self.block2(self.drop(self.block1(inputs))))))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(root: Path, module: TwiceDropped, accumulate: int = 1) -> dict[str, Any]:
    """Three optimizer steps at batch size 512 under the monitor; the report's JSON.

    Under accumulation the sampled step is batch 2, the first micro-batch of the second window.
    """
    monitor = VramMonitor(attribution_start_step=1 if accumulate == 1 else 2, console_summary=False)
    fit = trainer(root, [monitor], max_steps=3, accumulate_grad_batches=accumulate)
    fit.fit(module, loader(dataset(256, 2048), 512))
    data: dict[str, Any] = json.loads((root / "vram_report.json").read_text())
    return data


def plan_of(data: dict[str, Any], label: str) -> tuple[CheckpointPlan, int]:
    """A's replayed checkpointing plan labelled ``label``, with the peak its replay predicted (bytes)."""
    report = report_from_dict(data)
    assert report.simulation is not None
    (found,) = [
        (variant.change.plan, variant.replayed.reported_bytes(variant.replayed.reported_peak))
        for variant in report.simulation.variants
        if isinstance(variant.change, CheckpointChange) and variant.change.label == label and variant.replayed
    ]
    return found


def applied_run(root: Path, before: dict[str, Any], label: str, accumulate: int = 1) -> dict[str, Any]:
    """Run A again with its plan labelled ``label`` applied as printed."""
    plan, _ = plan_of(before, label)
    _, code = checkpoint_snippet(plan)
    torch.manual_seed(0)
    module = TwiceDropped()
    apply_printed(module, plan, code)
    return run(root, module, accumulate)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run A, and run B with A's plan holding the dropout applied as printed."""
    torch.manual_seed(0)
    before = run(tmp_path_factory.mktemp("a"), TwiceDropped())
    return before, applied_run(tmp_path_factory.mktemp("b"), before, PLAN_LABEL)


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs A and B (A's advised plan applied as printed) with ``accumulate_grad_batches=2``."""
    torch.manual_seed(0)
    before = run(tmp_path_factory.mktemp("acc_a"), TwiceDropped(), accumulate=2)
    return before, applied_run(tmp_path_factory.mktemp("acc_b"), before, ADVISED_LABEL, accumulate=2)


def with_chunked_loss(before: dict[str, Any]) -> dict[str, Any]:
    """Run A's report as though it had also advised chunked-loss (its saving modelled: 3 MiB)."""
    advice = {
        "id": "chunked-loss",
        "severity": "info",
        "title": "Compute the loss in chunks to lower the peak by about 3.0 MiB",
        "detail": "",
        "evidence": "",
        "estimated_saving_bytes": 3 * 2**20,
        "saving_basis": "modelled",
    }
    return {**before, "advice": [*before["advice"], advice]}


def test_a_module_called_twice_is_one_unit_of_as_plan(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = runs
    assert after["recomputed_units"].count(["drop.block"]) == 2
    assert len(after["recomputed_units"]) == 5
    _, predicted = plan_of(before, PLAN_LABEL)
    measured = after["peak"]["allocated_bytes"]
    lines = diff_lines(before, after, tmp_path, capsys)
    print("\n".join(lines))
    assert prediction_line(predicted, PLAN_LABEL, measured) in lines
    assert "  units recomputed in backward (activation checkpointing): 0 -> 4 (recomputed 5 times in all)" in lines
    assert not any("no checkpointing plan A's replay simulated" in line for line in lines)
    assert not any("window_first" in entry for entry in before["simulation"]["variants"])  # no accumulation


def test_a_module_recomputed_twice_is_not_the_chunked_loss(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A's chunked-loss advice, B applying only the checkpointing: no verdict on a chunked loss."""
    before, after = runs
    chunking = with_chunked_loss(before)
    _, predicted = plan_of(before, PLAN_LABEL)
    measured = after["peak"]["allocated_bytes"]
    lines = diff_lines(chunking, after, tmp_path, capsys)
    assert prediction_line(predicted, PLAN_LABEL, measured) in lines
    assert not any("chunked-loss advice applied" in line for line in lines)
    # The dropout alone, recomputed twice: a unit no plan of A's is, and still no chunked loss.
    alone = {**after, "recomputed_units": [["drop.block"], ["drop.block"]]}
    assert [line for line in diff_lines(chunking, alone, tmp_path, capsys) if line.startswith("B recomputed")] == [
        "B recomputed 1 unit(s) in backward that no checkpointing plan A's replay simulated: no prediction to check"
        f" (B measured {format_bytes(measured)})"
    ]


def test_the_output_layer_once_per_chunk_beside_the_plan(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """B applied the plan and the chunked loss (the head recomputed once per chunk): no plan predicted both."""
    before, after = runs
    both = {**after, "recomputed_units": [*after["recomputed_units"], *[["head"]] * LOSS_CHUNKS]}
    _, predicted = plan_of(before, PLAN_LABEL)
    measured = after["peak"]["allocated_bytes"]
    fell = before["peak"]["allocated_bytes"] - measured
    lines = [line for line in diff_lines(with_chunked_loss(before), both, tmp_path, capsys) if "B measured" in line]
    assert lines == [
        f"B recomputed head {LOSS_CHUNKS} times in backward: A's chunked-loss advice applied ({LOSS_CHUNKS} chunks);"
        f" it promised about 3.0 MiB (modelled), the peak fell {format_bytes(fell)}"
        f" ({fell / (3 * 2**20):.1%} of it) (B measured {format_bytes(measured)})",
        f"B recomputed 4 unit(s) in backward as A's {PLAN_LABEL} does, beside the chunked loss: A's replay predicted"
        f" {format_bytes(predicted)} for that plan alone, none for both together: no verdict (B measured"
        f" {format_bytes(measured)})",
    ]


def accumulated_variant(data: dict[str, Any]) -> dict[str, Any]:
    """A's advised plan's entry among its replayed variants."""
    (entry,) = [entry for entry in data["simulation"]["variants"] if entry["change"] == ADVISED_LABEL]
    return entry


def measured_on_the_first_micro_batch(after: dict[str, Any]) -> dict[str, Any]:
    """B's report as written before the window's stepping micro-batch was sampled too: its peak is the sampled first
    micro-batch's, the highest live peak its replay's baseline measured."""
    baseline = after["simulation"]["baseline"]
    assert baseline["window_first"] is True and baseline["step"] == 2
    first = max(part["measured_bytes"] for part in baseline["parts"] if part["part"] == "live peak")
    peak = {key: value for key, value in after["peak"].items() if key != "micro_batch"}
    return {**after, "peak": {**peak, "step": 2, "allocated_bytes": first}}


def test_under_accumulation_the_stepping_micro_batch_is_set_against_the_steady_prediction(
    accumulated: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = accumulated
    assert (after["peak"]["step"], after["peak"]["micro_batch"]) == (3, 2)
    steady, measured = accumulated_variant(before)["predicted_peak_bytes"], after["peak"]["allocated_bytes"]
    lines = [line for line in diff_lines(before, after, tmp_path, capsys) if line.startswith("A's replay predicted")]
    assert lines == [
        f"A's replay predicted {format_bytes(steady)} for {ADVISED_LABEL}, B measured {format_bytes(measured)}"
        f" (diff {(measured - steady) / steady:+.1%})"
    ]
    assert abs(measured - steady) <= 0.01 * steady  # like with like: within the replay's own tolerance


def test_under_accumulation_the_first_micro_batch_is_set_against_its_prediction(
    accumulated: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's trial (ViT, ``accumulate_grad_batches=2``): the steady prediction (51.7 MiB) against B's first
    micro-batch (49.4 MiB), "diff -4.4%", where the advice had promised about 49.4 MiB."""
    before, after = accumulated[0], measured_on_the_first_micro_batch(accumulated[1])
    assert after["simulation"]["baseline"]["window_first"] is True and after["peak"]["step"] == 2
    entry = accumulated_variant(before)
    steady = entry["predicted_peak_bytes"]
    first = max(phase["peak_bytes"] for phase in entry["window_first"].values())
    measured = after["peak"]["allocated_bytes"]
    assert first < steady
    lines = [line for line in diff_lines(before, after, tmp_path, capsys) if line.startswith("A's replay predicted")]
    assert lines == [
        f"A's replay predicted {format_bytes(first)} for {ADVISED_LABEL} on an accumulation window's first"
        f" micro-batch ({format_bytes(steady)} on the steady one, with the optimizer step), B measured"
        f" {format_bytes(measured)} on its first micro-batch (sampled step 2) (diff {(measured - first) / first:+.1%})"
    ]
    assert abs(measured - first) <= 0.01 * first  # like with like: within the replay's own tolerance


def test_under_accumulation_without_a_replayed_first_micro_batch_there_is_no_verdict(
    accumulated: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A's report written before variants kept their first micro-batch: the micro-batches differ, no verdict."""
    before, after = accumulated[0], measured_on_the_first_micro_batch(accumulated[1])
    variants = [
        {key: value for key, value in entry.items() if key != "window_first"}
        for entry in before["simulation"]["variants"]
    ]
    older = {**before, "simulation": {**before["simulation"], "variants": variants}}
    steady, measured = accumulated_variant(before)["predicted_peak_bytes"], after["peak"]["allocated_bytes"]
    lines = [line for line in diff_lines(older, after, tmp_path, capsys) if line.startswith("A's replay")]
    assert lines == [
        f"A's replay predicted {format_bytes(steady)} for {ADVISED_LABEL} on an accumulation window's steady"
        f" micro-batch (a later one, with the optimizer step), B measured {format_bytes(measured)} on its first"
        " micro-batch (sampled step 2): not the same micro-batch, no verdict"
    ]
    # Run A without accumulation: its prediction is of a whole step, said so.
    plain = {
        **older,
        "simulation": {key: value for key, value in older["simulation"].items() if key != "accumulate_grad_batches"},
    }
    lines = [line for line in diff_lines(plain, after, tmp_path, capsys) if line.startswith("A's replay")]
    assert lines == [
        f"A's replay predicted {format_bytes(steady)} for {ADVISED_LABEL} on a step without gradient accumulation,"
        f" B measured {format_bytes(measured)} on its first micro-batch (sampled step 2): not the same micro-batch,"
        " no verdict"
    ]


def test_a_variants_first_micro_batch_survives_the_report_file(
    accumulated: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """Written under accumulation only, and read back as written."""
    before, _ = accumulated
    assert all("window_first" in entry for entry in before["simulation"]["variants"] if entry["phases"])
    assert report_to_dict(report_from_dict(before)) == before
