"""Step time beside memory: the roofline per op, its parts, the calibration, the GPU table and the links.

Each figure is worked out by hand from a step of known ops on a device of known peaks.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_vram.prediction.devices import COMMON_GPUS
from lightning_vram.prediction.timing import (
    GPU_PEAKS,
    LINKS,
    DevicePeaks,
    calibrated,
    communication_seconds,
    gpu_peaks,
    host,
    measure_host,
    predict_step_time,
)
from lightning_vram.records import OpGroup, Phase, ReplayedStep, StepWork

DEVICE = DevicePeaks(
    "test device",
    fp32_flops=1e12,
    tf32_flops=4e12,
    bf16_flops=8e12,
    fp16_flops=8e12,
    bandwidth=1e11,
    op_overhead_seconds=1e-5,
    source="made up",
    achieved=0.5,
)
"""1 TFLOP/s in fp32 (4 in TF32, 8 in half), 100 GB/s, 10 us an op, half of it all reached."""


def step_of(*groups: OpGroup, batch_size: int | None = 16) -> ReplayedStep:
    work = StepWork(groups)
    return ReplayedStep("cuda", "32-true", batch_size, {}, (), 0, 0.0, flops=work.flops, work=work)


MATMUL = OpGroup(Phase.FORWARD, "fp32", flops=10**9, bytes_moved=10**6, count=2)
"""Two ops bound by arithmetic: each 1 GFLOP (2 ms at 0.5 TFLOP/s), 1 MB (0.02 ms at 50 GB/s)."""
ELEMENTWISE = OpGroup(Phase.BACKWARD, "fp32", flops=0, bytes_moved=10**8, count=3)
"""Three ops bound by memory: each 100 MB, 2 ms at 50 GB/s."""
RECOMPUTED = OpGroup(Phase.BACKWARD, "bf16", flops=4 * 10**9, bytes_moved=0, count=1, recomputed=True)
"""One recomputed op in bf16: 4 GFLOP, 1 ms at 4 TFLOP/s."""
VIEW = OpGroup(Phase.FORWARD, "fp32", flops=0, bytes_moved=0, count=5, view=True)


def test_each_op_takes_the_slower_of_its_arithmetic_and_its_traffic_plus_its_overhead() -> None:
    predicted = predict_step_time(step_of(MATMUL, ELEMENTWISE, RECOMPUTED, VIEW), DEVICE)
    print(predicted)
    assert predicted.compute_seconds == pytest.approx(2 * 2e-3 + 1e-3)
    assert predicted.memory_seconds == pytest.approx(3 * 2e-3)
    assert predicted.overhead_seconds == pytest.approx(11 * 1e-5)  # views are dispatched too
    assert predicted.recompute_seconds == pytest.approx(1e-3 + 1e-5)  # inside the parts above, not added
    assert predicted.communication_seconds == 0
    assert predicted.seconds == pytest.approx(11e-3 + 11e-5)
    assert predicted.samples_per_second == pytest.approx(16 / predicted.seconds)
    assert predicted.tokens_per_second is None
    assert "50% of peak" in predicted.basis
    assert "made up" in predicted.basis


def test_tf32_prices_fp32_products_at_the_tf32_rate_and_achieved_can_be_given() -> None:
    step = step_of(MATMUL)
    assert predict_step_time(step, DEVICE, tf32=True).compute_seconds == pytest.approx(2 * 0.5e-3)
    assert predict_step_time(step, DEVICE, achieved=1.0).compute_seconds == pytest.approx(2 * 1e-3)


def test_a_measured_share_for_a_kind_of_op_replaces_the_assumed_one() -> None:
    device = DevicePeaks(**{**DEVICE.__dict__, "op_achieved": {"relu": 0.1}})
    relu = OpGroup(Phase.FORWARD, "fp32", flops=0, bytes_moved=10**8, count=1, op="relu")
    assert predict_step_time(step_of(relu), device).memory_seconds == pytest.approx(1e8 / 1e10)


def test_communication_adds_its_bytes_over_the_link_and_tokens_come_from_the_length() -> None:
    link = LINKS["NVLink 4"]
    predicted = predict_step_time(step_of(MATMUL), DEVICE, 900 * 10**6, link, sequence_length=1024)
    assert predicted.communication_seconds == pytest.approx(2e-3)  # 900 MB at 450 GB/s one way
    assert predicted.seconds == pytest.approx(4e-3 + 2e-5 + 2e-3)
    assert predicted.tokens_per_second == pytest.approx(16 * 1024 / predicted.seconds)
    assert "NVLink 4" in predicted.basis
    assert communication_seconds(10**9, LINKS["100 Gb/s network"]) == pytest.approx(0.08)


def test_the_measured_step_calibrates_the_prediction_and_its_variants() -> None:
    predicted = predict_step_time(step_of(MATMUL), DEVICE)
    run = calibrated(predicted, 3 * predicted.seconds)
    assert run.calibration == pytest.approx(3.0)
    assert run.seconds == pytest.approx(3 * predicted.seconds)
    variant = predict_step_time(step_of(MATMUL, ELEMENTWISE), DEVICE, calibration=run.calibration)
    assert variant.seconds == pytest.approx(3 * (4e-3 + 6e-3 + 5e-5))
    assert calibrated(run, predicted.seconds).calibration == pytest.approx(1.0)  # from the uncalibrated figure


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: predict_step_time(ReplayedStep("cpu", "32-true", 1, {}, (), 0, 0.0), DEVICE), "count_flops=True"),
        (lambda: predict_step_time(step_of(MATMUL), DEVICE, achieved=0.0), "achieved must be a share"),
        (lambda: predict_step_time(step_of(MATMUL), DEVICE, 10), "link must be given"),
        (lambda: predict_step_time(step_of(MATMUL), DEVICE, sequence_length=0), "sequence_length must be"),
        (lambda: predict_step_time(step_of(MATMUL), DEVICE, calibration=math.nan), "calibration must be"),
        (lambda: communication_seconds(-1, LINKS["PCIe 4.0 x16"]), "bytes_per_rank must be an int >= 0, got -1"),
        (lambda: calibrated(predict_step_time(step_of(MATMUL), DEVICE), 0.0), "measured_seconds must be"),
        (lambda: measure_host(0), "repeats must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_naming_them(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()  # type: ignore[operator]


def test_every_common_gpu_row_has_published_peaks_with_their_source() -> None:
    rows = {name for name, _ in COMMON_GPUS}
    assert {peaks.memory_row for peaks in GPU_PEAKS.values()} == rows
    for peaks in GPU_PEAKS.values():
        assert "datasheet" in peaks.source or "whitepaper" in peaks.source
        assert peaks.bf16_flops >= peaks.fp32_flops
        assert peaks.tf32_flops >= peaks.fp32_flops
    h100 = GPU_PEAKS["H100 SXM"]
    assert (h100.bf16_flops, h100.bandwidth) == (989.5e12, 3.35e12)  # dense, not the 1,979 with sparsity
    assert gpu_peaks("NVIDIA H100 PCIe") is GPU_PEAKS["H100 PCIe"]
    assert gpu_peaks("NVIDIA H200") is GPU_PEAKS["H200 SXM"]
    assert gpu_peaks("NVIDIA A10") is GPU_PEAKS["A10"]
    assert gpu_peaks("NVIDIA A100-SXM4-80GB") is GPU_PEAKS["A100 80GB SXM"]


def test_the_host_is_measured_not_assumed_and_the_callers_random_state_stays() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with torch.no_grad():  # as a caller may be: its tiny training step still runs backward
        peaks = measure_host(1, time.process_time)
    assert torch.equal(torch.rand(3), expected)
    figures = (peaks.fp32_flops, peaks.bf16_flops, peaks.fp16_flops, peaks.bandwidth, peaks.op_overhead_seconds)
    assert all(0 < figure < math.inf for figure in figures)
    assert peaks.tf32_flops == peaks.fp32_flops
    assert peaks.achieved == 1.0
    assert set(peaks.op_achieved) >= {"convolution", "convolution_backward", "native_batch_norm", "relu", "_softmax"}
    assert all(share > 0 for share in peaks.op_achieved.values())
    assert "CPU time" in peaks.source


def test_measuring_the_host_runs_none_of_the_user_s_global_module_or_optimizer_hooks() -> None:
    calls: list[str] = []
    handles = [
        torch.nn.modules.module.register_module_forward_hook(lambda *_: calls.append("module")),
        register_optimizer_step_pre_hook(lambda *_: calls.append("optimizer")),
    ]
    try:
        measure_host(1, time.process_time)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == []


def test_the_host_measures_only_the_kinds_of_op_asked_for_and_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A run prices its own step: the kinds it does not run are not measured (each costs 0.1 to 0.5 s at the run's end).
    monkeypatch.setattr(host, "_MEASURED", [])
    measured: list[str] = []
    real = host._op_achieved

    def counting(*args: Any, **kwargs: Any) -> dict[str, float]:
        shares = real(*args, **kwargs)
        measured.extend(shares)
        return shares

    monkeypatch.setattr(host, "_op_achieved", counting)
    first = host.measure_host_peaks({"relu", "addmm"})  # addmm: no probe (its matrix products are priced as fp32's)
    assert set(first.op_achieved) == {"relu"}
    second = host.measure_host_peaks({"threshold_backward", "relu", "_safe_softmax"})  # a family of _softmax
    assert set(second.op_achieved) == {"relu", "threshold_backward", "_softmax"}
    assert second.op_achieved["relu"] == first.op_achieved["relu"] and second.fp32_flops == first.fp32_flops
    assert sorted(measured) == ["_softmax", "relu", "threshold_backward"]
    assert set(host.PROBED_KINDS) == set(host._probes())
