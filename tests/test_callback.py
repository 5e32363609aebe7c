"""The callback with real Trainers on the CPU: loggers, report files, exceptions, data wait."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import (
    Classifier,
    ScriptedClock,
    SlowToLoad,
    TimedClassifier,
    cnn_net,
    dataset_for,
    linear_net,
    loader,
    trainer,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.records import Phase


def test_report_json_equals_report_and_sits_in_default_root_dir_without_logger(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(cnn_net()), loader(dataset_for("cnn")))
    assert monitor.report is not None and monitor.report.ended_with is None
    assert monitor.report_path == tmp_path / "vram_report.json"
    written = json.loads(monitor.report_path.read_text())
    assert written == monitor.report.to_dict()
    assert written["schema"] == "lightning_vram.report/1"
    assert written["steps"] == 3
    assert written["device"]["type"] == "cpu"
    assert set(written["phases"]) == {"forward", "backward", "optimizer"}
    assert set(written["peak"]["breakdown"]) == {"parameters", "gradients", "optimizer_state", "activations", "other"}
    assert written["modules"][0]["activation_bytes"] >= written["modules"][-1]["activation_bytes"] > 0
    assert written["modules"][0]["type"] in {"BatchNorm2d", "ReLU", "Conv2d"}
    assert {"what", "reason"} <= set(written["not_measured"][0])
    assert written["ranks"] == [
        {"rank": 0, "device_index": None, "peak_bytes": written["peak"]["allocated_bytes"], "steps": 3}
    ]


def test_scalars_read_back_from_tensorboard_event_files(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = VramMonitor(
        log_every_n_steps=2, attribution_start_step=1, attribution_every_n_steps=2, console_summary=False
    )
    trainer(tmp_path, [monitor], max_steps=6, logger=logger).fit(Classifier(cnn_net()), loader(dataset_for("cnn")))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "vram/peak_bytes",
        "vram/peak/parameters_bytes",
        "vram/peak/activations_bytes",
        "vram/phase_peak/forward_bytes",
        "vram/data_wait_fraction",
        "vram/step_seconds",
        "vram/host_rss_bytes",
        "vram/peak/other_bytes",  # the live peak beyond the counted parts, measured on sampled steps
    } <= tags
    # Not measured on the CPU, so never logged (no fake zeros).
    assert not {"vram/allocated_bytes", "vram/reserved_bytes", "vram/gpu_utilization_percent"} & tags
    # Every 2 of 6 batches, at Lightning's own logging step (batches that stepped before this one: 1, 3, 5, where
    # self.log logs); the first batch has no batch before it, so every interval has a timed step.
    assert [event.step for event in events.Scalars("vram/step_seconds")] == [1, 3, 5]
    assert monitor.report is not None and monitor.report.peak is not None and monitor.report.peak.breakdown is not None
    parameters = [event.value for event in events.Scalars("vram/peak/parameters_bytes")]
    assert parameters == [monitor.report.peak.breakdown.parameters] * len(parameters)
    assert monitor.report_path == Path(logger.log_dir) / "vram_report.json"


def test_console_summary_names_the_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monitor = VramMonitor(attribution_start_step=1)
    trainer(tmp_path, [monitor], max_steps=2).fit(Classifier(cnn_net()), loader(dataset_for("cnn")))
    output = capsys.readouterr().out
    assert monitor.report is not None and monitor.report.peak is not None
    assert "VRAM report" in output
    assert f"in {monitor.report.peak.phase.value} of step 1" in output
    assert "not measured: allocator peaks" in output
    words = " ".join(output.split())  # lines folded to the terminal's width
    assert f"(why: {tmp_path / 'vram_report.md'})" in words  # where the reasons are, folder and all


def test_cpu_run_warns_once(tmp_path: Path) -> None:
    with pytest.warns(VramMonitorWarning, match="trains on cpu") as record:
        trainer(tmp_path, [VramMonitor(console_summary=False)], max_steps=3).fit(
            Classifier(linear_net()), loader(dataset_for("linear"))
        )
    assert sum(issubclass(item.category, VramMonitorWarning) for item in record) == 1


class Boom(ValueError):
    pass


class FailingClassifier(Classifier):
    def __init__(self, fail_at: int) -> None:
        super().__init__(cnn_net())
        self.fail_at = fail_at
        self.raised: BaseException | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            inputs, _ = batch
            self(inputs)  # part of a forward pass has run, with hooks installed, when the error comes
            self.raised = Boom("the user's own error")
            raise self.raised
        return super().training_step(batch, batch_idx)


def test_user_exception_passes_through_untouched_and_the_report_is_written(tmp_path: Path) -> None:
    module = FailingClassifier(fail_at=2)
    monitor = VramMonitor(attribution_start_step=2, console_summary=False)
    with pytest.raises(Boom) as caught:
        trainer(tmp_path, [monitor], max_steps=5).fit(module, loader(dataset_for("cnn")))
    assert caught.value is module.raised
    assert monitor.report is not None and monitor.report.steps == 2
    written = json.loads((tmp_path / "vram_report.json").read_text())
    assert written["steps"] == 2
    # Every view says the run failed (a trial's report of a failed run read as a finished one of 5 steps).
    assert monitor.report.ended_with == written["ended_with"] == "Boom: the user's own error"
    ended = "The run stopped with Boom: the user's own error: these figures cover its steps until then."
    assert ended in (tmp_path / "vram_report.md").read_text()
    assert ended.replace("'", "&#x27;") in (tmp_path / "vram_report.html").read_text()
    # The sampled step failed mid-forward: no saved-tensor hook and no module hook may be left behind.
    with torch.autograd.graph.disable_saved_tensors_hooks("a hook was left behind"):
        pass
    assert all(not child._forward_pre_hooks and not child._forward_hooks for child in module.modules())


def test_no_hooks_left_after_fit(tmp_path: Path) -> None:
    module = Classifier(cnn_net())
    trainer(tmp_path, [VramMonitor(attribution_start_step=0, attribution_every_n_steps=1, console_summary=False)]).fit(
        module, loader(dataset_for("cnn"))
    )
    with torch.autograd.graph.disable_saved_tensors_hooks("a hook was left behind"):
        pass
    assert all(not child._forward_pre_hooks and not child._forward_hooks for child in module.modules())
    assert all(not parameter._post_accumulate_grad_hooks for parameter in module.parameters())


def test_sampling_schedule_and_report_without_sample(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=50, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(Classifier(linear_net()), loader(dataset_for("linear")))
    assert monitor.report is not None
    assert monitor.report.peak is None  # CPU without a counted step: nothing measured, and the report says so
    assert any("attribution_start_step=50" in item.reason for item in monitor.report.not_measured)


@pytest.mark.parametrize(("load_seconds", "share"), [(0.0, 0.0), (0.03, 0.06 / 0.062)])
def test_data_wait_is_measured_between_batches(tmp_path: Path, load_seconds: float, share: float) -> None:
    # Batches of 2 samples, each taking load_seconds to load, and steps of 2 ms, on a scripted clock.
    clock = ScriptedClock()
    monitor = VramMonitor(attribution_start_step=100, console_summary=False, clock=clock)
    data = SlowToLoad(dataset_for("linear", samples=16), clock, load_seconds)
    trainer(tmp_path, [monitor], max_steps=8).fit(
        TimedClassifier(linear_net(), clock, seconds=0.002), loader(data, batch_size=2)
    )
    assert monitor.report is not None
    assert monitor.report.timing.data_wait_fraction == pytest.approx(share)
    assert monitor.report.timing.step_seconds_median == pytest.approx(2 * load_seconds + 0.002)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")  # on purpose here
def test_training_step_without_loss_closes_forward_at_batch_end(tmp_path: Path) -> None:
    class SkipsEveryOther(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx % 2 else loss

    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=1, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(SkipsEveryOther(linear_net()), loader(dataset_for("linear")))
    assert monitor.report is not None
    assert monitor.report.steps == 3  # Lightning still steps the optimizer on a batch without loss
    assert monitor.report.phases[Phase.FORWARD].step in (0, 1, 2)
    assert monitor.report.phases[Phase.BACKWARD].step != 1  # batch 1 had no backward
    with torch.autograd.graph.disable_saved_tensors_hooks("a hook was left behind"):
        pass


def test_a_report_handed_back_from_a_spawned_rank_is_read_once_and_its_file_removed(tmp_path: Path) -> None:
    # ddp_spawn's rank zero runs in a copy of the monitor in another process; here the copy is this process.
    import gc
    import os

    from lightning_vram.codec import report_from_dict, report_to_dict

    report = report_from_dict(json.loads((Path(__file__).parent / "data/reports/0.10.0/cpu.json").read_text()))
    monitor = VramMonitor()
    handback = monitor._handback
    assert not handback.in_a_copy() and monitor.report is None
    handback.builder = os.getpid() + 1  # as in the spawned rank zero
    handback.send(report, tmp_path / "vram_report.json")
    assert handback.path.is_file() and monitor.report is None  # a copy reads nothing back
    handback.builder = os.getpid()  # the user's monitor, after fit
    assert monitor.report is not None and report_to_dict(monitor.report) == report_to_dict(report)
    assert monitor.report_path == tmp_path / "vram_report.json"
    assert not handback.path.exists()  # read once, then removed; the report stays
    assert monitor.report is not None and report_to_dict(monitor.report) == report_to_dict(report)
    handback.send(report, None)  # never read: removed when the monitor goes away
    assert handback.path.is_file()
    path = handback.path
    del monitor, handback
    gc.collect()
    assert not path.exists()
