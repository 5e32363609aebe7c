"""NVML sampling against a stand-in ``pynvml`` module: device mapping by UUID, averaging, missing or failing NVML."""
# The stand-in module gets its functions by attribute assignment, which mypy cannot see on a ModuleType.
# mypy: disable-error-code="attr-defined"

from __future__ import annotations

import os
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.measure._nvml import NvmlSampler, NvmlUnavailableError
from lightning_vram.measure.probes import NvmlUtilization


class FakeNvmlError(Exception):
    pass


@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: int | None


@dataclass
class FakeNvml:
    """Two GPUs; utilization values are handed out in order, then the last one repeats."""

    uuids: tuple[str, ...] = ("GPU-aaaa-0000", "GPU-bbbb-1111")
    utilization: dict[int, list[int]] = field(default_factory=lambda: {0: [5], 1: [30, 50, 70]})
    processes: list[FakeProcess] = field(default_factory=lambda: [FakeProcess(os.getpid(), 900)])
    fail_init: bool = False
    fail_after_samples: int | None = None
    samples: int = 0
    shutdowns: int = 0
    init_error: Exception | None = None
    """Raised by nvmlInit, as bindings do that raise something other than NVMLError."""
    count_error: Exception | None = None
    """Raised by nvmlDeviceGetCount."""
    sample_error: Exception = field(default_factory=lambda: FakeNvmlError("GPU is lost"))
    """Raised by the utilization read once ``fail_after_samples`` samples were taken."""
    shutdown_error: Exception | None = None

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        module.NVMLError = FakeNvmlError
        module.nvmlInit = self.init
        module.nvmlShutdown = self.shutdown
        module.nvmlDeviceGetCount = self.count
        module.nvmlDeviceGetHandleByIndex = lambda index: index
        module.nvmlDeviceGetUUID = lambda handle: self.uuids[handle]
        module.nvmlDeviceGetUtilizationRates = self.rates
        module.nvmlDeviceGetComputeRunningProcesses = lambda handle: self.processes
        return module

    def init(self) -> None:
        if self.fail_init:
            raise FakeNvmlError("Driver Not Loaded")
        if self.init_error is not None:
            raise self.init_error

    def count(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return len(self.uuids)

    def shutdown(self) -> None:
        self.shutdowns += 1
        if self.shutdown_error is not None:
            raise self.shutdown_error

    def rates(self, handle: int) -> types.SimpleNamespace:
        if self.fail_after_samples is not None and self.samples >= self.fail_after_samples:
            raise self.sample_error
        values = self.utilization[handle]
        value = values[min(self.samples, len(values) - 1)]
        self.samples += 1
        return types.SimpleNamespace(gpu=value, memory=0)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


def wait_for(condition: object, timeout: float = 120.0) -> None:
    """Poll until ``condition()``; the timeout is reached only by a sampler that never samples, not by a slow one."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the sampler did not sample in time"
        time.sleep(0.005)


def test_device_is_found_by_uuid_not_index(nvml: FakeNvml) -> None:
    # Under CUDA_VISIBLE_DEVICES=1, torch's cuda:0 is NVML's device 1; torch reports the UUID without prefix.
    sampler = NvmlSampler("bbbb-1111", interval_seconds=0.01)
    sampler.start()
    wait_for(lambda: nvml.samples >= 3)
    sampler.stop()
    reading = sampler.take()
    assert reading.gpu_utilization_percent is not None
    assert 30 <= reading.gpu_utilization_percent <= 70  # device 1's values, never device 0's 5%
    assert reading.process_memory_bytes == 900
    assert sampler.run_mean_percent() == pytest.approx(reading.gpu_utilization_percent)
    assert nvml.shutdowns == 1


def test_take_averages_per_interval(nvml: FakeNvml) -> None:
    nvml.utilization[1] = [20, 40, 90]
    sampler = NvmlSampler("GPU-bbbb-1111", interval_seconds=0.01)
    sampler.start()
    wait_for(lambda: nvml.samples >= 3)
    sampler.stop()
    # The sample at start (20%) is of NVML's window before the run: checked, not averaged; then 40%, then 90% on.
    taken = nvml.samples - 1
    assert sampler.take().gpu_utilization_percent == pytest.approx((40 + 90 * (taken - 1)) / taken)
    assert sampler.take().gpu_utilization_percent is None  # no sample since: not measured, not zero


def test_a_run_shorter_than_the_sampling_interval_has_no_utilization_not_zero(nvml: FakeNvml) -> None:
    # The quickstart on a GPU: 60 steps of 3.8 ms, no sample of the thread in the run; the one at start read the idle
    # GPU (0%) in NVML's window before training.
    nvml.utilization[1] = [0, 0]
    utilization = NvmlUtilization(interval_seconds=3600)  # the thread's first sample never comes
    utilization.start("bbbb-1111")
    assert nvml.samples == 1
    reading = utilization.take()
    assert reading is not None and reading.gpu_utilization_percent is None  # not measured, not 0%
    assert reading.process_memory_bytes == 900  # the start sample's process memory is kept
    assert utilization.run_mean_percent() is None
    assert [(note.what, note.reason) for note in utilization.unavailable()] == [
        ("GPU utilization", "run shorter than the sampling interval of 3600 s")
    ]
    utilization.stop()


def test_missing_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailableError, match="nvidia-ml-py"):
        NvmlSampler("bbbb-1111", 0.1).start()


def test_driver_not_loaded(nvml: FakeNvml) -> None:
    nvml.fail_init = True
    with pytest.raises(NvmlUnavailableError, match="Driver Not Loaded"):
        NvmlSampler("bbbb-1111", 0.1).start()


def test_unknown_device(nvml: FakeNvml) -> None:
    with pytest.raises(NvmlUnavailableError, match="no device with UUID cccc"):
        NvmlSampler("cccc", 0.1).start()
    assert nvml.shutdowns == 1


def test_failure_while_sampling_stops_the_thread_and_keeps_what_was_measured(nvml: FakeNvml) -> None:
    nvml.fail_after_samples = 2
    sampler = NvmlSampler("bbbb-1111", interval_seconds=0.01)
    sampler.start()
    wait_for(lambda: sampler.error is not None)
    assert sampler.error is not None and "GPU is lost" in sampler.error
    assert sampler.take().gpu_utilization_percent == pytest.approx(50.0)  # 50; the 30 at start is before the run
    sampler.stop()


def test_process_in_another_pid_namespace_is_not_measured(nvml: FakeNvml) -> None:
    nvml.processes = [FakeProcess(pid=1, usedGpuMemory=900)]
    sampler = NvmlSampler("bbbb-1111", interval_seconds=3600)
    sampler.start()
    assert sampler.take().process_memory_bytes is None
    sampler.stop()


# What NVML bindings raise besides NVMLError: a missing symbol in an old library, a broken driver install, a
# malformed answer, a bug in the bindings.
OTHER_FAILURES = [
    RuntimeError("NVML library version mismatch"),
    AttributeError("module 'pynvml' has no attribute 'nvmlDeviceGetUtilizationRates'"),
    OSError("libnvidia-ml.so.1: cannot open shared object file"),
    ValueError("invalid literal for int()"),
    KeyError("gpu"),
    TypeError("'NoneType' object is not subscriptable"),
]


@pytest.mark.parametrize("error", OTHER_FAILURES, ids=lambda error: type(error).__name__)
def test_any_failure_of_the_bindings_at_start_means_unavailable(nvml: FakeNvml, error: Exception) -> None:
    nvml.init_error = error
    with pytest.raises(NvmlUnavailableError, match=f"NVML could not start: {type(error).__name__}"):
        NvmlSampler("bbbb-1111", 0.1).start()
    nvml.init_error, nvml.count_error = None, error
    with pytest.raises(NvmlUnavailableError, match=f"NVML could not list devices: {type(error).__name__}"):
        NvmlSampler("bbbb-1111", 0.1).start()
    assert nvml.shutdowns == 1  # initialised the second time, so released again


@pytest.mark.parametrize("error", OTHER_FAILURES, ids=lambda error: type(error).__name__)
def test_any_failure_while_sampling_ends_the_thread_quietly(nvml: FakeNvml, error: Exception) -> None:
    # A thread dying with a traceback would reach pytest's threadexception plugin and fail this test.
    nvml.fail_after_samples, nvml.sample_error = 2, error
    sampler = NvmlSampler("bbbb-1111", interval_seconds=0.01)
    sampler.start()
    wait_for(lambda: sampler.error is not None)
    assert sampler.error == f"NVML sampling failed: {type(error).__name__}: {error}"
    assert sampler.take().gpu_utilization_percent == pytest.approx(50.0)  # 50; the 30 at start is before the run
    nvml.shutdown_error = error  # and a teardown that fails as well
    sampler.stop()
    assert nvml.shutdowns == 1


def test_a_first_sample_that_fails_means_unavailable(nvml: FakeNvml) -> None:
    nvml.fail_after_samples, nvml.sample_error = 0, RuntimeError("Unknown Error")
    with pytest.raises(NvmlUnavailableError, match="NVML sampling failed: RuntimeError: Unknown Error"):
        NvmlSampler("bbbb-1111", 0.1).start()
    assert nvml.shutdowns == 1


def test_bindings_that_fail_on_import_mean_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pynvml.py").write_text('raise OSError("NVML Shared Library Not Found")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with pytest.raises(NvmlUnavailableError, match="failed to load: OSError: NVML Shared Library Not Found"):
        NvmlSampler("bbbb-1111", 0.1).start()


def test_the_probe_turns_a_failed_start_into_one_warning_and_one_note(nvml: FakeNvml) -> None:
    nvml.init_error = RuntimeError("NVML library version mismatch")
    utilization = NvmlUtilization(interval_seconds=0.01)
    with pytest.warns(VramMonitorWarning, match="NVML could not start: RuntimeError") as warned:
        utilization.start("bbbb-1111")
    assert len(warned) == 1
    assert utilization.take() is None and utilization.run_mean_percent() is None
    [note] = utilization.unavailable()
    assert note.reason == "NVML could not start: RuntimeError: NVML library version mismatch"
    utilization.stop()


def test_the_probe_turns_a_sampling_failure_into_one_warning_and_one_note(nvml: FakeNvml) -> None:
    nvml.fail_after_samples, nvml.sample_error = 2, AttributeError("'NoneType' object has no attribute 'gpu'")
    utilization = NvmlUtilization(interval_seconds=0.01)
    utilization.start("bbbb-1111")
    wait_for(lambda: nvml.samples >= 2 and utilization._sampler is not None and utilization._sampler.error is not None)
    with pytest.warns(VramMonitorWarning, match="utilization sampling stopped") as warned:
        notes = utilization.unavailable()  # the report asks at the end, even if no log interval took a reading
    assert utilization.take() is not None  # no second warning from here on (warnings are errors in the tests)
    assert utilization.run_mean_percent() == pytest.approx(50.0)
    assert len(warned) == 1
    assert [note.what for note in notes] == ["GPU utilization after the error"]
    assert "AttributeError" in notes[0].reason
    assert utilization.unavailable() == notes
    utilization.stop()
