"""NVML sampling against a stand-in ``pynvml`` module: device mapping by UUID, averaging, missing or failing NVML."""

from __future__ import annotations

import os
import sys
import time
import types
from dataclasses import dataclass, field

import pytest

from lightning_vram.measure._nvml import NvmlSampler, NvmlUnavailableError


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

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        module.NVMLError = FakeNvmlError  # type: ignore[attr-defined]
        module.nvmlInit = self.init  # type: ignore[attr-defined]
        module.nvmlShutdown = self.shutdown  # type: ignore[attr-defined]
        module.nvmlDeviceGetCount = lambda: len(self.uuids)  # type: ignore[attr-defined]
        module.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
        module.nvmlDeviceGetUUID = lambda handle: self.uuids[handle]  # type: ignore[attr-defined]
        module.nvmlDeviceGetUtilizationRates = self.rates  # type: ignore[attr-defined]
        module.nvmlDeviceGetComputeRunningProcesses = lambda handle: self.processes  # type: ignore[attr-defined]
        return module

    def init(self) -> None:
        if self.fail_init:
            raise FakeNvmlError("Driver Not Loaded")

    def shutdown(self) -> None:
        self.shutdowns += 1

    def rates(self, handle: int) -> types.SimpleNamespace:
        if self.fail_after_samples is not None and self.samples >= self.fail_after_samples:
            raise FakeNvmlError("GPU is lost")
        values = self.utilization[handle]
        value = values[min(self.samples, len(values) - 1)]
        self.samples += 1
        return types.SimpleNamespace(gpu=value, memory=0)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake


def wait_for(condition: object, timeout: float = 5.0) -> None:
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
    sampler = NvmlSampler("GPU-bbbb-1111", interval_seconds=3600)  # only the first sample, at start
    sampler.start()
    first = sampler.take()
    assert first.gpu_utilization_percent == 20
    assert sampler.take().gpu_utilization_percent is None  # no sample since: not measured, not zero
    sampler.stop()


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
    assert sampler.take().gpu_utilization_percent == pytest.approx(40.0)  # mean of 30 and 50
    sampler.stop()


def test_process_in_another_pid_namespace_is_not_measured(nvml: FakeNvml) -> None:
    nvml.processes = [FakeProcess(pid=1, usedGpuMemory=900)]
    sampler = NvmlSampler("bbbb-1111", interval_seconds=3600)
    sampler.start()
    assert sampler.take().process_memory_bytes is None
    sampler.stop()
