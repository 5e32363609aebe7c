"""``lightning-vram diff`` on two real runs: settings, timing, changed advice, and run A's prediction checked by run B.

Run A trains a small MLP on the CPU in 32-true; its replay simulates ``precision="bf16-mixed"`` and checkpointing
plans. Run B is the same run in bf16-mixed; another run B applies A's checkpointing advice as printed. Also
``show --json`` and ``html -o -`` on a real report.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Classifier, dataset, loader, mlp, trainer
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.cli import main
from lightning_vram.codec import report_from_dict, report_to_dict
from lightning_vram.units import format_bytes, format_percent

# Run B checks run A's replayed predictions; the shared runs replay (the library's defaults, as every fixture
# wider than a test).
pytestmark = pytest.mark.replay


class AsAdvised(Classifier):
    """The classifier whose forward runs ``code`` (checkpointing advice, as printed) instead of ``self.network(x)``."""

    def __init__(self, network: nn.Module, code: str) -> None:
        super().__init__(network)
        self.code = compile(code, "<advice>", "exec")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        scope = {"self": self, "x": inputs}
        exec(self.code, scope)
        return scope["x"]  # type: ignore[return-value]


def run(root: Path, precision: str, code: str | None = None) -> dict[str, Any]:
    """Three steps of the MLP at batch size 512 in ``precision`` (with ``code`` in its forward); the report's JSON."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    module = Classifier(mlp(256, 8)) if code is None else AsAdvised(mlp(256, 8), code)
    trainer(root, [monitor], max_steps=3, precision=precision).fit(module, loader(dataset(256, 2048), 512))
    data: dict[str, Any] = json.loads((root / "vram_report.json").read_text())
    return data


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    return run(tmp_path_factory.mktemp("a"), "32-true"), run(tmp_path_factory.mktemp("b"), "bf16-mixed")


def checkpointing_advice(data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The report's checkpointing advice and the code it prints."""
    (advice,) = [entry for entry in data["advice"] if entry["id"] == "activation-checkpointing"]
    (code,) = re.findall(r"```python\n(.*?)\n```", advice["detail"], re.DOTALL)
    return advice, code


@pytest.fixture(scope="module")
def checkpointed(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run A again with its checkpointing advice applied as printed."""
    _, code = checkpointing_advice(runs[0])
    return run(tmp_path_factory.mktemp("checkpointed"), "32-true", code)


def write(data: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(data))
    return path


def diff_lines(
    before: dict[str, Any], after: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> list[str]:
    assert main(["diff", str(write(before, tmp_path / "a.json")), str(write(after, tmp_path / "b.json"))]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out.splitlines()


def variant(data: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [entry for entry in data["simulation"]["variants"] if entry["kind"] == kind]
    return found


def prediction_line(predicted: int, label: str, measured: int) -> str:
    return (
        f"A's replay predicted {format_bytes(predicted)} for {label}, B measured {format_bytes(measured)}"
        f" (diff {(measured - predicted) / predicted:+.1%})"
    )


def test_a_precision_b_applied_is_checked_against_as_replay(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = runs
    lines = diff_lines(before, after, tmp_path, capsys)
    predicted = variant(before, "precision")["predicted_peak_bytes"]
    measured = after["peak"]["allocated_bytes"]
    assert prediction_line(predicted, 'precision="bf16-mixed"', measured) in lines
    assert abs(measured - predicted) / predicted < 0.05  # the replay's own promise, here within 5%
    assert len([line for line in lines if line.startswith("A's replay predicted")]) == 1


def test_a_checkpointing_plan_b_applied_as_printed_is_checked_against_as_replay(
    runs: tuple[dict[str, Any], dict[str, Any]],
    checkpointed: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before, _ = runs
    advice, code = checkpointing_advice(before)
    assert "for start, end in ((0, 4), (4, 8), (8, 12)):\n    segment = self.network[start:end]" in code
    # B re-ran each checkpointed segment in backward, last first; A recomputed nothing.
    assert checkpointed["recomputed_units"] == [
        [f"network.{index}" for index in range(start, start + 4)] for start in (8, 4, 0)
    ]
    assert before["recomputed_units"] == []
    lines = diff_lines(before, checkpointed, tmp_path, capsys)
    assert "  units recomputed in backward (activation checkpointing): 0 -> 3" in lines
    predicted = advice["predicted_peak_bytes"]
    (planned,) = [
        entry
        for entry in before["simulation"]["variants"]
        if entry["kind"] == "checkpoint" and entry["parameters"]["sequential_segments"] == 4
    ]
    assert planned["predicted_peak_bytes"] == predicted
    measured = checkpointed["peak"]["allocated_bytes"]
    # Only the plan B applied: 3 and 5 segments were replayed too (5 over the same modules, split otherwise).
    assert [line for line in lines if line.startswith("A's replay predicted")] == [
        prediction_line(predicted, "checkpoint network in 4 segments", measured)
    ]
    assert abs(measured - predicted) / predicted < 0.05


def test_a_checkpointing_plan_is_matched_segment_by_segment(
    runs: tuple[dict[str, Any], dict[str, Any]],
    checkpointed: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before, _ = runs
    in_threes = [[f"network.{index}" for index in range(start, start + 3)] for start in (9, 6, 3, 0)]
    lines = diff_lines(before, {**checkpointed, "recomputed_units": in_threes}, tmp_path, capsys)
    (five,) = [
        entry for entry in before["simulation"]["variants"] if entry["change"] == "checkpoint network in 5 segments"
    ]
    measured = checkpointed["peak"]["allocated_bytes"]
    assert [line for line in lines if line.startswith("A's replay predicted")] == [
        prediction_line(five["predicted_peak_bytes"], "checkpoint network in 5 segments", measured)
    ]
    # Not recorded (a report from before), or one more unit than the plan, or another precision: no prediction.
    unrecorded = {key: value for key, value in checkpointed.items() if key != "recomputed_units"}
    more = {**checkpointed, "recomputed_units": [["network.12"], *checkpointed["recomputed_units"]]}
    for after in (unrecorded, more, {**checkpointed, "precision": "bf16-mixed"}):
        lines = diff_lines(before, after, tmp_path, capsys)
        assert not any(line.startswith("A's replay predicted") and " for checkpoint " in line for line in lines)


def test_the_settings_and_timing_of_both_runs(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = runs
    lines = diff_lines(before, after, tmp_path, capsys)
    start = lines.index("run:")
    seconds_before, seconds_after = (data["timing"]["step_seconds_median"] for data in runs)
    ratio = seconds_after / seconds_before
    waits = [format_percent(data["timing"]["data_wait_fraction"]) for data in runs]
    device = f"cpu {before['device']['name']} ({format_bytes(before['device']['total_bytes'])})"
    assert lines[start + 1 : start + 8] == [
        "  precision: 32-true -> bf16-mixed",
        "  batch size: 512 in both runs",
        "  world size: 1 in both runs",
        f"  device: {device} in both runs",
        f"  step time (median): {seconds_before * 1000:.1f} ms -> {seconds_after * 1000:.1f} ms ({ratio:.2f}x); step"
        " times vary"
        " (interquartile range over the median) not recorded in A, not recorded in B: reliability unknown",
        f"  data wait (of step time): {waits[0]} -> {waits[1]}",
        "  units recomputed in backward (activation checkpointing): 0 in both runs",
    ]
    assert lines[1] == f"  in {before['peak']['phase']} in both runs"


def test_advice_with_the_same_id_and_another_saving_is_changed(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = runs
    lines = diff_lines(before, after, tmp_path, capsys)
    assert "advice: unchanged" not in lines
    (advice_before,) = [entry for entry in before["advice"] if entry["id"] == "activation-checkpointing"]
    (advice_after,) = [entry for entry in after["advice"] if entry["id"] == "activation-checkpointing"]
    assert advice_before["estimated_saving_bytes"] != advice_after["estimated_saving_bytes"]
    (changed,) = [line for line in lines if line.startswith("advice changed: activation-checkpointing: ")]
    saving = (
        f"saving {format_bytes(advice_before['estimated_saving_bytes'])} ->"
        f" {format_bytes(advice_after['estimated_saving_bytes'])}"
    )
    assert saving in changed
    assert f'"{advice_before["title"]}" -> "{advice_after["title"]}"' in changed
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert "advice: unchanged" in capsys.readouterr().out.splitlines()


def test_no_prediction_where_b_changed_more_than_the_change(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = runs
    lines = diff_lines(before, {**after, "batch_size": 256}, tmp_path, capsys)
    assert "  batch size: 512 -> 256" in lines
    assert not any(line.startswith("A's replay predicted") for line in lines)


def test_a_batch_size_b_applied_is_checked(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CPU run replays no batch size: A's precision variant is read as a batch-size one, B's batch size set to it.
    before, _ = runs
    edited = json.loads(json.dumps(before))
    replayed = variant(edited, "precision")
    replayed.update(kind="batch-size", parameters={"batch_size": 256}, change="batch size 256")
    lines = diff_lines(edited, {**before, "batch_size": 256}, tmp_path, capsys)
    assert (
        prediction_line(replayed["predicted_peak_bytes"], "batch size 256", before["peak"]["allocated_bytes"]) in lines
    )


def test_settings_an_old_report_lacks_are_not_recorded(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0.1.0 wrote no precision, no batch size and no simulation; 0.10.0 no recomputed units.
    before, after = runs
    absent = ("precision", "batch_size", "simulation", "recomputed_units")
    old = {key: value for key, value in before.items() if key not in absent}
    lines = diff_lines(old, after, tmp_path, capsys)
    assert "  precision: not recorded -> bf16-mixed" in lines
    assert "  batch size: not recorded -> 512" in lines
    assert "  units recomputed in backward (activation checkpointing): not recorded -> 0" in lines
    assert not any(line.startswith("A's replay predicted") for line in lines)


def test_show_json_prints_the_report_in_todays_schema(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, _ = runs
    old = {key: value for key, value in before.items() if key not in ("simulation", "shapes", "recent_peaks")}
    assert main(["show", "--json", str(write(old, tmp_path / "vram_report.json"))]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(report_to_dict(report_from_dict(old))))
    assert printed["simulation"] is None and printed["shapes"] is None and printed["recent_peaks"] == []
    assert main(["show", "--json", str(write(before, tmp_path / "vram_report.json"))]) == 0
    assert json.loads(capsys.readouterr().out) == before


def test_html_to_standard_output(
    runs: tuple[dict[str, Any], dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before, _ = runs
    path = write(before, tmp_path / "vram_report.json")
    monkeypatch.chdir(tmp_path)
    assert main(["html", str(path), "-o", "-"]) == 0
    page = capsys.readouterr().out
    assert page.lower().startswith("<!doctype html>")
    assert main(["html", str(path), "-o", str(tmp_path / "page.html")]) == 0
    assert page == (tmp_path / "page.html").read_text()
    assert not (tmp_path / "-").exists()


def test_a_prediction_is_not_judged_against_a_run_that_stopped_with_an_error(
    runs: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run B applied A's precision and ran out of memory after some steps: its peak is of the steps before, not of
    the step that failed, so the line gives no verdict (it read "diff +0.0%", the prediction met)."""
    before, after = runs
    stopped = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    lines = diff_lines(before, {**after, "ended_with": stopped}, tmp_path, capsys)
    predicted = variant(before, "precision")["predicted_peak_bytes"]
    measured = after["peak"]["allocated_bytes"]
    assert prediction_line(predicted, 'precision="bf16-mixed"', measured) not in lines
    assert (
        f'A\'s replay predicted {format_bytes(predicted)} for precision="bf16-mixed", B measured'
        f" {format_bytes(measured)} on its steps before it stopped with {stopped}: not its whole run, no verdict"
    ) in lines
