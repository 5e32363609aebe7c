"""Hand-built run summaries, setups and module profiles for the advice tests: a healthy run and its variations."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_vram.records import (
    Breakdown,
    DeviceInfo,
    LinearLayer,
    ModuleProfile,
    Phase,
    PhasePeak,
    RunSummary,
    TrainingSetup,
)

GIB = 1024**3
MIB = 1024**2
GPU = DeviceInfo("cuda", "NVIDIA A100", 0, 16 * GIB, (8, 0))
CPU = DeviceInfo("cpu", "x86_64", None, 64 * GIB)
HEALTHY_BREAKDOWN = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=GIB, activations=3 * GIB, other=2 * GIB)


def peak(
    phase: Phase, total: int, breakdown: Breakdown | None = HEALTHY_BREAKDOWN, reserved: int | None = None
) -> PhasePeak:
    return PhasePeak(step=5, phase=phase, peak_bytes=total, reserved_bytes=reserved, breakdown=breakdown)


def healthy_summary(**changes: Any) -> RunSummary:
    """A run no rule should comment on: 8 of 16 GiB at the backward peak, busy GPU, no data wait, bf16."""
    summary = RunSummary(
        device=GPU,
        peak=peak(Phase.BACKWARD, 8 * GIB, reserved=8 * GIB + 512 * MIB),
        phases={
            Phase.FORWARD: peak(Phase.FORWARD, 7 * GIB),
            Phase.BACKWARD: peak(Phase.BACKWARD, 8 * GIB),
            Phase.OPTIMIZER: peak(Phase.OPTIMIZER, 4 * GIB),
        },
        modules=(),
        batch_size=32,
        step_seconds_median=0.1,
        data_wait_fraction=0.01,
        recent_data_wait_fraction=0.01,
        timed_steps=200,
        gpu_utilization_mean=92.0,
        alloc_retries=0,
        cuda_context_bytes=300 * MIB,
    )
    return replace(summary, **changes)


def healthy_setup(**changes: Any) -> TrainingSetup:
    setup = TrainingSetup(
        precision="bf16-mixed",
        automatic_optimization=True,
        accumulate_grad_batches=1,
        optimizers=("SGD",),
        num_workers=7,
        pin_memory=True,
        cpu_cores_per_device=8,
        world_size=1,
        strategy="SingleDeviceStrategy",
        parameter_bytes=GIB,
        linear_layers=(LinearLayer("head", 512, 10, 20_520),),
    )
    return replace(setup, **changes)


def blocks(count: int, saved: int, input_bytes: int) -> tuple[ModuleProfile, ...]:
    # The blocks of an nn.ModuleList: the list itself is never called, so it has no profile.
    return tuple(
        ModuleProfile(f"encoder.layers.{index}", "TransformerEncoderLayer", saved, input_bytes=input_bytes)
        for index in range(count)
    )


def leaky_relu() -> ModuleProfile:
    """An out-of-place LeakyReLU that saved its 200 MiB input; the next op saved its output."""
    return ModuleProfile(
        "body.1",
        "LeakyReLU",
        200 * MIB,
        input_bytes=200 * MIB,
        output_bytes=200 * MIB,
        inplace=False,
        input_saved_bytes=200 * MIB,
        output_saved_for_backward=True,
    )


def forward_peak_summary(backward_bytes: int) -> RunSummary:
    return healthy_summary(
        peak=peak(Phase.FORWARD, 8 * GIB),
        phases={
            Phase.FORWARD: peak(Phase.FORWARD, 8 * GIB),
            Phase.BACKWARD: peak(Phase.BACKWARD, backward_bytes),
            Phase.OPTIMIZER: peak(Phase.OPTIMIZER, 4 * GIB),
        },
    )


def headroom_summary(**changes: Any) -> RunSummary:
    small = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=GIB, activations=600 * MIB, other=424 * MIB)
    return healthy_summary(**{"peak": peak(Phase.BACKWARD, 4 * GIB, small), "gpu_utilization_mean": 40.0, **changes})
