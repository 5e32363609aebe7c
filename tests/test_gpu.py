"""Real CUDA allocator and NVML paths. Run on a machine with a CUDA GPU (``pytest -m gpu``)."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from models import FLOAT32, OPTIMIZERS, PARAMETER_COUNTS, Classifier, cnn_net, dataset_for, loader, trainer
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.measure.probes import CudaProbe
from lightning_vram.records import Phase

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MIB = 1024**2
TEST_TRACES = "LIGHTNING_VRAM_GPU_TEST_TRACES"
"""A directory where the GPU tests that compare the replay with the allocator write the allocator's trace of their fit
(``torch.cuda.memory._snapshot()`` with Python stacks: which call made each block); ``scripts/gpu_check.py --traces``
sets it."""


@contextlib.contextmanager
def traced(name: str) -> Iterator[None]:
    """Records the allocator's events inside the block into ``$LIGHTNING_VRAM_GPU_TEST_TRACES/name.pickle`` (if set).

    Recording adds no allocation: the blocks, and so the peaks the test compares, are the same with it and without.
    """
    directory = os.environ.get(TEST_TRACES)
    if not directory:
        yield
        return
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        Path(directory).mkdir(parents=True, exist_ok=True)
        with (Path(directory) / f"{name}.pickle").open("wb") as file:
            pickle.dump(snapshot, file)


def test_allocator_counters_and_peak_reset() -> None:
    probe = CudaProbe(utilization_interval_seconds=0.1)
    device = torch.device("cuda", torch.cuda.current_device())
    info = probe.open(device)
    try:
        assert info.type == "cuda" and info.total_bytes == torch.cuda.get_device_properties(device).total_memory
        kept = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
        probe.read_allocator(reset_peak=True)
        temporary = torch.empty(128 * MIB, dtype=torch.uint8, device=device)
        del temporary
        reading = probe.read_allocator(reset_peak=True)
        assert reading is not None
        assert reading.allocated_bytes == torch.cuda.memory_allocated(device)
        assert reading.reserved_bytes == torch.cuda.memory_reserved(device)
        assert reading.peak_allocated_bytes >= reading.allocated_bytes + 128 * MIB
        after_reset = probe.read_allocator(reset_peak=False)
        assert after_reset is not None and after_reset.peak_allocated_bytes == after_reset.allocated_bytes
        # A step read once: the peak reset alone at its start, one read at its end gives the step's peak.
        temporary = torch.empty(256 * MIB, dtype=torch.uint8, device=device)
        del temporary
        probe.reset_peak()
        step = torch.empty(32 * MIB, dtype=torch.uint8, device=device)
        del step
        once = probe.read_allocator(reset_peak=True)
        assert once is not None and once.peak_allocated_bytes == once.allocated_bytes + 32 * MIB
        del kept
    finally:
        probe.close()


def test_nvml_sees_this_process_and_its_work() -> None:
    probe = CudaProbe(utilization_interval_seconds=0.05)
    device = torch.device("cuda", torch.cuda.current_device())
    probe.open(device)
    try:
        # Before NVML's first sample the run is shorter than the interval: "n/a", never a 0% reading (issue 24, 9).
        (early,) = probe.unavailable()
        assert "shorter than the sampling interval" in early.reason
        matrix = torch.randn(4096, 4096, device=device)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            matrix = (matrix @ matrix).tanh_()
        torch.cuda.synchronize(device)
        reading = probe.take_utilization()
        assert reading is not None and reading.gpu_utilization_percent is not None
        assert reading.gpu_utilization_percent > 10
        assert probe.unavailable() == ()
        if reading.process_memory_bytes is not None:  # None where NVML runs in another PID namespace
            assert reading.process_memory_bytes >= torch.cuda.memory_reserved(device)
    finally:
        probe.close()


def test_fit_on_gpu_attributes_the_peak(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=2, console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=6, accelerator="gpu")
    fit.fit(Classifier(cnn_net()), loader(dataset_for("cnn"), batch_size=64))
    report = monitor.report
    assert report is not None and report.device.type == "cuda" and report.peak is not None
    assert report.not_measured == ()
    assert set(report.phases) == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    breakdown = report.peak.breakdown
    assert breakdown is not None and breakdown.other is not None and breakdown.other >= 0
    assert breakdown.parameters == PARAMETER_COUNTS["cnn"] * FLOAT32
    assert report.peak.reserved_bytes is not None and report.peak.reserved_bytes >= report.peak.peak_bytes
    assert report.device.total_bytes is not None and report.peak.peak_bytes < report.device.total_bytes


class SyncGuard(pl.Callback):
    """Turns synchronisation into an error just before VramMonitor's hooks and back to normal just after."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def _set(self, *_: Any) -> None:
        torch.cuda.set_sync_debug_mode(self.mode)

    on_train_batch_start = on_before_backward = on_before_optimizer_step = on_train_batch_end = _set


# torch warns once, as the guard first sets a mode, that the debug mode is a prototype: the suite turns warnings into
# errors, which stopped fit inside the guard's hook with "error" still set (Lightning's teardown then synchronised).
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
def test_monitor_hooks_never_synchronise(tmp_path: Path) -> None:
    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=2, log_every_n_steps=1, console_summary=False
    )
    callbacks: list[pl.Callback] = [SyncGuard("error"), monitor, SyncGuard("default")]
    try:
        trainer(tmp_path, callbacks, max_steps=6, accelerator="gpu", logger=CSVLogger(tmp_path)).fit(
            Classifier(cnn_net()), loader(dataset_for("cnn"), batch_size=64)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert monitor.report is not None and monitor.report.steps == 6


class AllocatesTooMuch(Classifier):
    """Asks for twice the device's memory at batch 3."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            capacity = torch.cuda.get_device_properties(self.device).total_memory
            torch.empty(2 * capacity, dtype=torch.uint8, device=self.device)
        return super().training_step(batch, batch_idx)


def test_real_oom_leaves_a_diagnosis_and_a_snapshot(tmp_path: Path) -> None:
    monitor = VramMonitor(record_history=True, console_summary=False)
    # 8 batches an epoch, so that batch 3 comes (one batch an epoch never reached it).
    data = loader(dataset_for("cnn", samples=8 * 64), batch_size=64)
    assert len(data) > 3
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer(tmp_path, [monitor], max_steps=6, accelerator="gpu").fit(AllocatesTooMuch(cnn_net()), data)
    diagnosis = monitor.oom_diagnosis
    assert diagnosis is not None and (diagnosis.where, diagnosis.step) == ("forward", 3)
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    assert diagnosis.message.tried_bytes is not None
    assert abs(diagnosis.message.tried_bytes - 2 * capacity) < 0.01 * capacity  # torch prints 2 decimals
    assert diagnosis.capacity_bytes is not None and abs(diagnosis.capacity_bytes - capacity) < 0.01 * capacity
    assert (tmp_path / "vram_oom_report.md").read_text().startswith("# Out of memory: ")
    snapshot = tmp_path / "vram_oom_snapshot.pickle"
    assert snapshot.read_bytes()[:2] == b"\x80\x04"  # pickle protocol 4
    with snapshot.open("rb") as file:
        assert "segments" in pickle.load(file)


# torch's FSDP on one device shards nothing and says so; what the test checks is that rank's count all the same.
@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
def test_lightning_fsdp_counts_this_ranks_shards(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=3, accelerator="gpu", devices=1, strategy="fsdp")
    fit.fit(Classifier(cnn_net()), loader(dataset_for("cnn"), batch_size=64))
    report = monitor.report
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    optimizer = report.phases[Phase.OPTIMIZER].breakdown
    assert optimizer is not None
    # One device holds the whole flat parameter: every byte of the model once, plus FSDP's alignment padding.
    exact = PARAMETER_COUNTS["cnn"] * FLOAT32
    assert exact <= optimizer.parameters <= exact + 4096
    assert exact <= optimizer.gradients <= exact + 4096


def test_lightning_deepspeed_stage_3_counts_this_ranks_partitions(tmp_path: Path) -> None:
    # A GPU machine's image may lack deepspeed (`make test` installs it; the device machines here have none).
    pytest.importorskip("deepspeed", reason="deepspeed is not installed in this environment")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1_000_000},
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": 64,
    }
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    fit = trainer(
        tmp_path, [monitor], max_steps=3, accelerator="gpu", devices=1, strategy=DeepSpeedStrategy(config=config)
    )
    fit.fit(Classifier(cnn_net(), OPTIMIZERS["adam"]), loader(dataset_for("cnn"), batch_size=64))
    report = monitor.report
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    forward = report.phases[Phase.FORWARD].breakdown
    assert forward is not None
    # One device holds every partition: the whole model in ds_tensor (param.data is empty), its gradient buffer,
    # and the ZeRO optimizer's fp32 master copy beside Adam's two moments.
    exact = PARAMETER_COUNTS["cnn"] * FLOAT32
    assert exact <= forward.parameters <= exact + 4096
    assert exact <= forward.gradients <= exact + 4096
    assert 3 * exact <= forward.optimizer_state <= 3 * exact + 8192
    assert report.peak.breakdown.other is not None and report.peak.breakdown.other >= 0


@pytest.mark.replay
def test_replayed_allocator_peaks_match_the_real_ones_per_phase(tmp_path: Path) -> None:
    """The fake-CUDA replay of a sampled step, through the allocator model, against the allocator's own peaks.

    Allocated and reserved per phase within 2%, cuBLAS's workspaces included: ``simulation.calibration`` holds the
    replay's own figures (before anything measured is carried) beside the measured ones. The network is matmuls only
    (cuBLAS, whose workspace the replay simulates): cuDNN's convolution workspaces are measured and carried, not
    replayed (scripts/gpu_check.py's ResNet-50 rows show them). Prints each phase's figures for
    docs/gpu-validation.md.
    """
    # The replay models a process whose allocator starts empty: what earlier tests left in the small pool (a failed
    # test's traceback keeps its model alive) filled a 2 MiB segment the fit then had to add to.
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # as a fresh process, which the replay's own workspaces stand for
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    assert left == 0, f"the device holds {left} B of earlier tests' tensors: the comparison needs an empty allocator"
    network = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    with traced("test-replayed-allocator-peaks"):  # the blocks the replay misses, with the calls that made them
        trainer(tmp_path, [monitor], max_steps=4, accelerator="gpu").fit(
            Classifier(network, OPTIMIZERS["adam"]), loader(dataset_for("linear", samples=256), batch_size=64)
        )
    report = monitor.report
    assert report is not None and report.simulation is not None, "no replay"
    simulation = report.simulation
    assert simulation.skipped is None and simulation.device_type == "cuda", simulation.skipped
    calibration = simulation.calibration
    assert calibration is not None, "no allocator readings beside the replay"
    assert {phase.phase for phase in calibration.phases} == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    for phase in calibration.phases:
        print(
            f"{phase.phase.value}: allocated replayed {phase.replayed_allocated_bytes} B,"
            f" measured {phase.measured_allocated_bytes} B ({phase.allocated_error}); reserved replayed"
            f" {phase.replayed_reserved_bytes} B, measured {phase.measured_reserved_bytes} B ({phase.reserved_error})"
        )
    for phase in calibration.phases:
        assert phase.replayed_allocated_bytes == pytest.approx(phase.measured_allocated_bytes, rel=0.02), phase
        assert phase.replayed_reserved_bytes is not None and phase.measured_reserved_bytes is not None, phase
        assert phase.replayed_reserved_bytes == pytest.approx(phase.measured_reserved_bytes, rel=0.02), phase


@pytest.mark.replay
def test_preflight_on_a_real_device_stays_silent_when_the_step_fits(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=100, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=1, accelerator="gpu").fit(Classifier(cnn_net()), loader(dataset_for("cnn")))
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and verdict.fits
    free, _ = torch.cuda.mem_get_info()
    assert verdict.needed_bytes < free


@pytest.mark.replay
def test_predict_agrees_for_a_model_on_the_cpu_and_on_the_gpu() -> None:
    """``predict()`` on a GPU machine with the model still on the CPU (a notebook) and with it moved to the GPU.

    Issue 24, item 5: the CPU model's replay failed ("Unhandled FakeTensor Device Propagation for
    aten.embedding.default, found two different devices cpu, cuda:0"). Both now replay on fake CUDA and agree, phase
    by phase, allocated and reserved (the same step, the same simulated allocator).
    """
    from replay_models import CausalLM

    from lightning_vram import predict

    torch.manual_seed(0)
    module = CausalLM()
    batch = (torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0)),)
    on_cpu = predict(module, batch, fit_table=False, budget_seconds=120.0)
    module.cuda()
    on_gpu = predict(module, tuple(tensor.cuda() for tensor in batch), fit_table=False, budget_seconds=120.0)
    for prediction in (on_cpu, on_gpu):
        assert prediction.skipped is None and prediction.step is not None, prediction.skipped
        assert prediction.step.device_type == "cuda"
    assert on_cpu.step is not None and on_gpu.step is not None
    figures = {
        name: {phase: (peak.peak_bytes, peak.reserved_bytes) for phase, peak in step.phases.items()}
        for name, step in (("cpu", on_cpu.step), ("gpu", on_gpu.step))
    }
    print(f"predict() replayed, model on the CPU: {figures['cpu']}; on the GPU: {figures['gpu']}")
    assert figures["cpu"] == figures["gpu"]
    assert all(peak > 0 for peak, _ in figures["cpu"].values())
