"""One guard: a fault injected into each part of the monitor warns once, switches the part off, is reported, and
training finishes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import Classifier, dataset_for, linear_net, loader, trainer

from lightning_vram import VramMonitor, VramMonitorWarning, VramSession
from lightning_vram._guard import Part
from lightning_vram.measure import history
from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.batch_shapes import ShapeRecorder
from lightning_vram.measure.probes import Probe
from lightning_vram.measure.timing import StepTimer
from lightning_vram.measure.tracker import MemoryTracker
from lightning_vram.session import advisor, assembly, sinks
from lightning_vram.session.recorder import PHASE_READ_STEPS
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

MIB = 1024**2
STEPS = 6


class Boom(RuntimeError):
    """The injected fault."""


def boom(*_args: Any, **_kwargs: Any) -> Any:
    raise Boom("injected")


class FailingProbe(ScriptedProbe):
    """A scripted CUDA probe whose ``method`` raises from its ``after``-th call on."""

    def __init__(self, method: str, after: int = 0) -> None:
        super().__init__([ScriptedBoundary(100 * MIB, 512 * MIB, 150 * MIB)])
        self._failing, self._after, self._calls = method, after, 0

    def __getattribute__(self, name: str) -> Any:
        if name != "_failing" and name == object.__getattribute__(self, "_failing"):
            calls = object.__getattribute__(self, "_calls") + 1
            object.__setattr__(self, "_calls", calls)
            if calls > object.__getattribute__(self, "_after"):
                return boom
        return object.__getattribute__(self, name)


def inject(monkeypatch: pytest.MonkeyPatch, part: Part) -> FailingProbe | None:
    """Make ``part`` fail; returns the probe to use when the fault lives in it."""
    targets: dict[Part, Callable[[], None]] = {
        Part.TRACKER: lambda: monkeypatch.setattr(MemoryTracker, "close_phase", boom),
        Part.ATTRIBUTION: lambda: monkeypatch.setattr(StepAttributor, "_pack_counted", boom),
        Part.TIMING: lambda: monkeypatch.setattr(StepTimer, "batch_ended", boom),
        Part.SHAPES: lambda: monkeypatch.setattr(ShapeRecorder, "observe", boom),
        Part.SCALARS: lambda: monkeypatch.setattr(assembly, "interval_scalars", boom),
        Part.REPORT: lambda: monkeypatch.setattr(assembly, "build_report", boom),
        Part.FILES: lambda: monkeypatch.setattr(sinks, "write_report_files", boom),
        Part.CONSOLE: lambda: monkeypatch.setattr(sinks, "print_summary", boom),
        Part.REPLAY: lambda: monkeypatch.setattr(advisor, "try_changes", boom),
    }
    if part is Part.ALLOCATOR:
        return FailingProbe("read_allocator", after=5)
    if part is Part.UTILIZATION:
        return FailingProbe("take_utilization")
    if part is Part.PROBE:
        return FailingProbe("unavailable")
    targets[part]()
    return None


GUARDED_IN_A_FIT = [part for part in Part if part not in (Part.OOM, Part.HISTORY, Part.STATE, Part.RANKS)]


def with_replays(value: object, replayed: bool) -> Any:
    """The parameter, marked ``replay`` where it is the replay that fails (the tests' monitors replay only if asked)."""
    return pytest.param(value, marks=pytest.mark.replay) if replayed else value


@pytest.mark.parametrize(
    "part",
    [with_replays(part, part is Part.REPLAY) for part in GUARDED_IN_A_FIT],
    ids=[part.name for part in GUARDED_IN_A_FIT],
)
def test_a_failing_part_warns_once_is_switched_off_and_training_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: Part
) -> None:
    probe = inject(monkeypatch, part) or ScriptedProbe([ScriptedBoundary(100 * MIB, 512 * MIB, 150 * MIB)])
    monitor = VramMonitor(probe=probe, log_every_n_steps=2, attribution_start_step=1, attribution_every_n_steps=1)
    module = Classifier(linear_net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(tmp_path, [monitor], max_steps=STEPS, logger=TensorBoardLogger(tmp_path, name="tb"))
        fit.fit(module, loader(dataset_for("linear")))
    assert fit.global_step == STEPS  # training finished
    ours = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
    assert ours == [next(message for message in ours if message.startswith(f"VramMonitor: {part.value} failed"))]
    assert "Boom: injected" in ours[0]
    if part is Part.REPORT:
        assert monitor.report is None  # nothing to list it in: the warning is the report
        return
    assert monitor.report is not None
    assert [item.what for item in monitor.report.not_measured if "failed with" in item.reason] == [part.value]
    assert monitor.report.steps == STEPS


PROBE_METHODS = {
    "open": Part.PROBE,
    "read_allocator": Part.ALLOCATOR,
    "reset_peak": Part.ALLOCATOR,  # on steps read once, after the run's first PHASE_READ_STEPS
    "take_utilization": Part.UTILIZATION,
    "mean_utilization_percent": Part.UTILIZATION,
    "host_rss_bytes": Part.UTILIZATION,
    "free_bytes": Part.REPLAY,  # read once, by the preflight replay
    "unavailable": Part.PROBE,
    "close": Part.PROBE,
}


@pytest.mark.parametrize(
    "method",
    [with_replays(method, part is Part.REPLAY) for method, part in PROBE_METHODS.items()],
    ids=list(PROBE_METHODS),
)
def test_a_probe_raising_in_any_method_warns_once_and_the_report_is_written(tmp_path: Path, method: str) -> None:
    assert set(PROBE_METHODS) == {name for name in dir(Probe) if not name.startswith("_")}
    steps = PHASE_READ_STEPS + 2 if method == "reset_peak" else STEPS
    monitor = VramMonitor(probe=FailingProbe(method), log_every_n_steps=2, attribution_start_step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(tmp_path, [monitor], max_steps=steps)
        fit.fit(Classifier(linear_net()), loader(dataset_for("linear")))
    assert fit.global_step == steps
    ours = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
    ours = [text for text in ours if "trains on cpu" not in text]  # the model does: said when the probe cannot
    assert len(ours) == 1 and ours[0].startswith(f"VramMonitor: {PROBE_METHODS[method].value} failed with Boom")
    assert monitor.report is not None and monitor.report.steps == steps
    assert (tmp_path / "vram_report.json").exists()


def test_a_failing_allocator_history_is_reported_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history, "unavailable_reason", lambda: None)
    monkeypatch.setattr(history, "start_recording", boom)
    session = VramSession(probe=ScriptedProbe([ScriptedBoundary(0, 0, 0)]), record_history=True, console_summary=False)
    model = torch.nn.Linear(4, 2)
    with pytest.warns(VramMonitorWarning, match="allocator history failed with Boom"):
        session.start(model, device=torch.device("cuda"))
    session.batch_start()
    session.batch_end()
    report = session.finish()
    assert report is not None
    assert "allocator history" in [item.what for item in report.not_measured]


def test_the_users_own_error_passes_through_untouched(tmp_path: Path) -> None:
    class Fails(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                raise self.error
            return super().training_step(batch, batch_idx)

    module = Fails(linear_net())
    module.error = KeyError("the user's own")
    monitor = VramMonitor(attribution_start_step=2, console_summary=False)
    with pytest.raises(KeyError) as raised:
        trainer(tmp_path, [monitor], max_steps=STEPS).fit(module, loader(dataset_for("linear")))
    assert raised.value is module.error
    assert monitor.report is not None and monitor.report.steps == 2
