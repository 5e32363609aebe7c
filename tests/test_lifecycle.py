"""Runs that train nothing, fast_dev_run, checkpoint state that cannot be used, and two monitors in one Trainer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier, dataset_for, linear_net, loader, trainer

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.records import Phase
from lightning_vram.session.assembly import NO_STEP


@pytest.mark.parametrize("options", [{"limit_train_batches": 0}, {"max_epochs": 0, "max_steps": -1}])
def test_a_run_that_trains_nothing_gives_an_empty_report(tmp_path: Path, options: dict[str, Any]) -> None:
    monitor = VramMonitor(console_summary=False)
    trainer(tmp_path, [monitor], **options).fit(Classifier(linear_net()), loader(dataset_for("linear")))
    report = monitor.report
    assert report is not None
    assert report.steps == 0 and report.peak is None and report.advice == ()
    assert NO_STEP in report.not_measured
    assert json.loads((tmp_path / "vram_report.json").read_text())["steps"] == 0
    assert report.to_dict()["peak"] is None


def test_fast_dev_run_writes_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monitor = VramMonitor(attribution_start_step=0, console_summary=False)
    trainer(tmp_path / "root", [monitor], fast_dev_run=True).fit(
        Classifier(linear_net()), loader(dataset_for("linear"))
    )
    assert monitor.report is not None and monitor.report.steps == 1
    assert monitor.report_path is None
    assert list(tmp_path.rglob("vram_report.*")) == []


def checkpoint_of_a_run(tmp_path: Path, monitor: VramMonitor | None) -> tuple[Path, str]:
    callbacks = [monitor] if monitor is not None else []
    fit = trainer(tmp_path / "first", callbacks, max_steps=4)
    fit.fit(Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)))
    path = tmp_path / "run.ckpt"
    fit.save_checkpoint(path)
    return path, monitor.state_key if monitor is not None else ""


CORRUPTIONS: dict[str, Any] = {
    "a string": "not a state",
    "another version": {"version": 1, "tracker": {}, "timer": {}},
    "a missing key": {"version": 2, "timer": {}},
    "a negative step count": "negative",
    "a string where bytes go": "string-bytes",
    "a list where seconds go": "list-seconds",
}


def corrupted(state: dict[str, Any], how: str) -> Any:
    corruption = CORRUPTIONS[how]
    if corruption == "negative":
        state["tracker"]["steps"] = -3
    elif corruption == "string-bytes":
        state["tracker"]["peak"]["peak_bytes"] = "900"
    elif corruption == "list-seconds":
        state["timer"]["run_total"] = [1.0]
    else:
        return corruption
    return state


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupted_monitor_state_warns_once_and_starts_fresh(tmp_path: Path, how: str) -> None:
    first = VramMonitor(attribution_start_step=0, console_summary=False)
    path, key = checkpoint_of_a_run(tmp_path, first)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"][key] = corrupted(checkpoint["callbacks"][key], how)
    torch.save(checkpoint, path)

    second = VramMonitor(attribution_start_step=0, console_summary=False)
    with pytest.warns(VramMonitorWarning, match="monitor state cannot be used") as warned:
        trainer(tmp_path / "second", [second], max_steps=6).fit(
            Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)), ckpt_path=path
        )
    assert sum("monitor state cannot be used" in str(item.message) for item in warned) == 1
    assert second.report is not None and second.report.steps == 2  # fresh: only the steps since the resume


def test_resuming_from_a_checkpoint_written_without_the_monitor_says_so(tmp_path: Path) -> None:
    path, _ = checkpoint_of_a_run(tmp_path, None)
    monitor = VramMonitor(console_summary=False)
    with pytest.warns(VramMonitorWarning, match="carries no state of this monitor"):
        trainer(tmp_path / "second", [monitor], max_steps=6).fit(
            Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)), ckpt_path=path
        )
    assert monitor.report is not None and monitor.report.steps == 2


def test_two_monitors_with_different_settings_work_in_one_trainer_and_resume(tmp_path: Path) -> None:
    often = VramMonitor(attribution_start_step=0, attribution_every_n_steps=1, console_summary=False)
    once = VramMonitor(attribution_start_step=3, attribution_every_n_steps=None, console_summary=False)
    assert often.state_key != once.state_key
    fit = trainer(tmp_path / "first", [often, once], max_steps=4)
    fit.fit(Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)))
    assert often.report is not None and once.report is not None
    assert often.report.steps == once.report.steps == 4
    # Step 3 is sampled by both: the first monitor counts it (saved-tensor hooks do not nest), the second says so.
    assert often.report.peak is not None and often.report.peak.breakdown is not None
    assert often.report.phases[Phase.FORWARD].breakdown.activations > 0  # type: ignore[union-attr]
    assert "another monitor" in " ".join(item.reason for item in once.report.not_measured)
    # Each writes its own files: the second into a folder of its own.
    assert often.report_path == tmp_path / "first" / "vram_report.json"
    assert once.report_path == tmp_path / "first" / "vram_monitor_1" / "vram_report.json"
    path = tmp_path / "run.ckpt"
    fit.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["callbacks"]
    assert saved[often.state_key]["tracker"]["steps"] == saved[once.state_key]["tracker"]["steps"] == 4

    again = [
        VramMonitor(attribution_start_step=0, attribution_every_n_steps=1, console_summary=False),
        VramMonitor(attribution_start_step=3, attribution_every_n_steps=None, console_summary=False),
    ]
    trainer(tmp_path / "second", list(again), max_steps=6).fit(
        Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)), ckpt_path=path
    )
    assert [monitor.report.steps for monitor in again if monitor.report is not None] == [6, 6]


def test_checkpoint_state_round_trips_every_field_of_a_sampled_step() -> None:
    from lightning_vram.measure.tracker import MemoryTracker
    from lightning_vram.records import Attribution, Breakdown, ModuleProfile, Phase

    profile = ModuleProfile(
        name="head",
        type="Linear",
        activation_bytes=4096,
        input_bytes=8192,
        output_bytes=40,
        inplace=None,
        input_saved_for_backward=True,
        input_saved_bytes=8192,
        output_saved_bytes=0,
        output_saved_for_backward=False,
        input_feature_map=(64, 16),
    )
    recomputed = (("net.2", "net.3"), ("blocks.0.block",))
    attribution = Attribution(
        3, {Phase.FORWARD: Breakdown(10, 0, 20, 4096, None)}, (profile,), batch_size=8, recomputed_units=recomputed
    )
    tracker = MemoryTracker(recent_steps=4, peak_was_reset=True)
    tracker.start_step(None)
    tracker.end_step(attribution)
    restored = MemoryTracker(recent_steps=4, peak_was_reset=True)
    state = tracker.state_dict()
    restored.load_state_dict(state)
    assert restored.latest_attribution == attribution
    assert restored.peak == tracker.peak and restored.steps == 1
    del state["latest_attribution"]["recomputed_units"]  # as a state written before they were recorded
    restored.load_state_dict(state)
    assert restored.latest_attribution == replace(attribution, recomputed_units=None)


@pytest.mark.replay
def test_a_resumed_run_keeps_the_replay_of_the_run_before(tmp_path: Path) -> None:
    first = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    fit = trainer(tmp_path / "first", [first], max_steps=4)
    fit.fit(Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)))
    path = tmp_path / "run.ckpt"
    fit.save_checkpoint(path)
    assert first.report is not None and first.report.simulation is not None
    assert first.report.simulation.match is not None and first.report.simulation.match.matches

    second = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path / "second", [second], max_steps=6).fit(
        Classifier(linear_net(), OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=32)), ckpt_path=path
    )
    assert second.report is not None and second.report.simulation is not None
    # The same replay, but for the timelines drawn in "memory during one step": a checkpoint does not carry them.
    resumed, before = second.report.to_dict()["simulation"], first.report.to_dict()["simulation"]
    assert before["timeline"] is not None and resumed["timeline"] is None
    assert without_timelines(resumed) == without_timelines(before)


class StopsAnEpochAtItsThirdBatch(Classifier):
    """Ends the first epoch at batch 2 from ``on_train_batch_start`` (Lightning then skips that batch's end hooks)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 0 and batch_idx == 2 else None


def test_a_batch_stopped_at_its_start_blames_no_other_monitor(tmp_path: Path) -> None:
    # Batch 2 is sampled and never ends; each later batch is sampled too and counted by this, the only, monitor.
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=1, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=6, max_epochs=3).fit(
        StopsAnEpochAtItsThirdBatch(linear_net()), loader(dataset_for("linear"))
    )
    report = monitor.report
    assert report is not None and report.steps == 6
    assert not [item for item in report.not_measured if "another monitor" in item.reason]
    assert report.phases[Phase.FORWARD].breakdown is not None
    assert report.phases[Phase.FORWARD].breakdown.activations > 0


def without_timelines(simulation: dict[str, Any]) -> dict[str, Any]:
    """A report's ``simulation`` section without the replayed steps' timelines."""
    variants = [
        {key: value for key, value in variant.items() if key != "timeline"} for variant in simulation["variants"]
    ]
    return {**{key: value for key, value in simulation.items() if key != "timeline"}, "variants": variants}
