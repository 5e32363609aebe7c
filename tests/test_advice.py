"""Each rule on hand-built summaries: it fires with the right evidence and saving, and stays silent on the near miss."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lightning_vram.advice.rules import (
    COMMON_GPUS,
    activation_checkpointing,
    advise,
    allocator_fragmentation,
    batch_size_headroom,
    best_checkpoint_plan,
    dataloader_workers,
    fit_table,
    inplace_activations,
    large_linear,
    mixed_precision,
    near_capacity,
    optimizer_state,
    pin_memory,
    stale_gradients,
)
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


def test_a_healthy_run_gets_no_advice() -> None:
    assert advise(healthy_summary(), healthy_setup()) == ()


def blocks(count: int, saved: int, input_bytes: int) -> tuple[ModuleProfile, ...]:
    # The blocks of an nn.ModuleList: the list itself is never called, so it has no profile.
    return tuple(
        ModuleProfile(f"encoder.layers.{index}", "TransformerEncoderLayer", saved, input_bytes=input_bytes)
        for index in range(count)
    )


def test_activation_checkpointing_names_the_blocks_and_the_saving() -> None:
    # Four blocks of 750 MiB each, 64 MiB input each. Checkpointed, forward keeps 4 x 64 MiB; backward
    # recomputes one block at a time: peak = 3 x 64 + 750 = 942 MiB instead of 3000 MiB.
    summary = healthy_summary(modules=blocks(4, 750 * MIB, 64 * MIB))
    advice = activation_checkpointing(summary, healthy_setup())
    assert advice is not None
    assert advice.estimated_saving_bytes == (3000 - 942) * MIB
    assert "`encoder.layers.0`" in advice.title
    assert "activations are 37.5% of the backward peak (3.00 GiB of 8.00 GiB)" in advice.evidence
    assert "encoder.layers.0 750.0 MiB" in advice.evidence
    assert "checkpoint(block, x, use_reentrant=False)" in advice.detail


def test_activation_checkpointing_near_misses() -> None:
    modules = blocks(4, 750 * MIB, 64 * MIB)
    other_larger = replace(HEALTHY_BREAKDOWN, other=4 * GIB)  # activations no longer the largest part
    summary = healthy_summary(modules=modules, peak=peak(Phase.BACKWARD, 9 * GIB, other_larger))
    assert activation_checkpointing(summary, healthy_setup()) is None
    # Blocks whose input is as large as what they save free nothing.
    assert activation_checkpointing(healthy_summary(modules=blocks(4, 200 * MIB, 200 * MIB)), healthy_setup()) is None


def test_checkpoint_sequential_leaves_the_last_segment_alone() -> None:
    # An nn.Sequential of 4 layers saving 100 MiB each, 10 MiB inputs. In 2 segments: forward keeps 10 MiB for
    # the first segment and 200 MiB for the last; recomputing the first holds 200 MiB: peak 210 MiB of 400.
    layers = tuple(ModuleProfile(f"net.{index}", "Block", 100 * MIB, input_bytes=10 * MIB) for index in range(4))
    plan = best_checkpoint_plan((ModuleProfile("net", "Sequential", 0, input_bytes=10 * MIB), *layers))
    assert plan is not None
    # Each layer checkpointed alone: peak = max(100, 10 + 100, 20 + 100, 30 + 100) = 130 MiB -> saves 270 MiB.
    assert (plan.sequential_segments, plan.saving_bytes) == (None, 270 * MIB)
    two = best_checkpoint_plan((ModuleProfile("net", "Sequential", 0), *layers[:2]))
    assert two is not None and two.saving_bytes == 90 * MIB  # peak max(100, 10 + 100) = 110 MiB of 200
    assert best_checkpoint_plan((ModuleProfile("net", "Sequential", 0), layers[0])) is None  # one child: nothing


def test_inplace_activations_fires_on_large_safe_outputs_and_names_unsafe_ones() -> None:
    relu = ModuleProfile("body.1", "ReLU", 200 * MIB, input_bytes=200 * MIB, output_bytes=200 * MIB, inplace=False)
    unsafe = ModuleProfile("body.3", "ReLU", 0, output_bytes=300 * MIB, inplace=False, input_saved_for_backward=True)
    already = ModuleProfile("body.5", "ReLU", 0, output_bytes=400 * MIB, inplace=True)
    advice = inplace_activations(healthy_summary(modules=(relu, unsafe, already)), healthy_setup())
    assert advice is not None
    assert advice.estimated_saving_bytes == 200 * MIB
    assert "1 activation module(s) run out of place (ReLU)" in advice.evidence
    assert "the largest output is 200.0 MiB (body.1), 2.4% of the peak" in advice.evidence
    assert "autograd saved their input for an earlier op: body.3" in advice.evidence
    assert "residual connection" in advice.detail


def test_inplace_activations_near_misses() -> None:
    small = ModuleProfile("body.1", "ReLU", 0, output_bytes=150 * MIB, inplace=False)  # 1.8% of 8 GiB
    assert inplace_activations(healthy_summary(modules=(small,)), healthy_setup()) is None
    unsafe = ModuleProfile("body.1", "ReLU", 0, output_bytes=GIB, inplace=False, input_saved_for_backward=True)
    assert inplace_activations(healthy_summary(modules=(unsafe,)), healthy_setup()) is None
    dropout = ModuleProfile("drop", "Dropout", 0, output_bytes=GIB, inplace=False)
    assert inplace_activations(healthy_summary(modules=(dropout,)), healthy_setup()) is None


@pytest.mark.parametrize(
    ("capability", "precision"), [((8, 0), "bf16-mixed"), ((9, 0), "bf16-mixed"), ((7, 5), "16-mixed")]
)
def test_mixed_precision_picks_the_format_the_device_supports(capability: tuple[int, int], precision: str) -> None:
    summary = healthy_summary(device=replace(GPU, compute_capability=capability))
    advice = mixed_precision(summary, healthy_setup(precision="32-true"))
    assert advice is not None
    assert f'precision="{precision}"' in advice.title
    assert advice.estimated_saving_bytes == 3 * GIB // 2
    assert (
        "training in 32-true on NVIDIA A100; activations are 3.00 GiB of the 8.00 GiB backward peak" in advice.evidence
    )


def test_mixed_precision_near_misses() -> None:
    assert mixed_precision(healthy_summary(), healthy_setup(precision="16-mixed")) is None
    assert mixed_precision(healthy_summary(device=CPU), healthy_setup(precision="32-true")) is None
    few_activations = peak(Phase.BACKWARD, 8 * GIB, replace(HEALTHY_BREAKDOWN, activations=700 * MIB))
    assert mixed_precision(healthy_summary(peak=few_activations), healthy_setup(precision="32-true")) is None


def test_dataloader_workers_suggests_cores_and_step_time() -> None:
    summary = healthy_summary(data_wait_fraction=0.3, recent_data_wait_fraction=0.25, timed_steps=50)
    advice = dataloader_workers(summary, healthy_setup(num_workers=0))
    assert advice is not None
    assert "num_workers=7, persistent_workers=True" in advice.title
    assert advice.estimated_saving_seconds == pytest.approx(0.1 * 0.3)
    assert "data wait is 30.0% of step time over the run and 25.0% recently (50 timed steps), about 30.0 ms" in (
        advice.evidence
    )
    assert "num_workers=0, 8 CPU cores per device" in advice.evidence


def test_dataloader_workers_near_misses() -> None:
    setup = healthy_setup(num_workers=0)
    recovered = healthy_summary(data_wait_fraction=0.3, recent_data_wait_fraction=0.05, timed_steps=50)
    assert dataloader_workers(recovered, setup) is None  # a slow start, not sustained
    below = healthy_summary(data_wait_fraction=0.09, recent_data_wait_fraction=0.09, timed_steps=50)
    assert dataloader_workers(below, setup) is None
    few_steps = healthy_summary(data_wait_fraction=0.5, recent_data_wait_fraction=0.5, timed_steps=9)
    assert dataloader_workers(few_steps, setup) is None
    starved = healthy_summary(data_wait_fraction=0.3, recent_data_wait_fraction=0.3, timed_steps=50)
    assert dataloader_workers(starved, healthy_setup(num_workers=7)) is None  # no spare cores to give
    tiny_steps = replace(starved, step_seconds_median=0.006)  # 1.8 ms per step: Lightning's own loop, mostly
    assert dataloader_workers(tiny_steps, setup) is None


def test_pin_memory() -> None:
    waiting = healthy_summary(data_wait_fraction=0.06, recent_data_wait_fraction=0.06)
    advice = pin_memory(waiting, healthy_setup(pin_memory=False))
    assert advice is not None
    assert "data wait is 6.0% of step time on NVIDIA A100; pin_memory=False" in advice.evidence
    assert pin_memory(waiting, healthy_setup(pin_memory=True)) is None
    assert pin_memory(replace(waiting, device=CPU), healthy_setup(pin_memory=False)) is None
    barely = healthy_summary(data_wait_fraction=0.04, recent_data_wait_fraction=0.04)
    assert pin_memory(barely, healthy_setup(pin_memory=False)) is None


def forward_peak_summary(backward_bytes: int) -> RunSummary:
    return healthy_summary(
        peak=peak(Phase.FORWARD, 8 * GIB),
        phases={
            Phase.FORWARD: peak(Phase.FORWARD, 8 * GIB),
            Phase.BACKWARD: peak(Phase.BACKWARD, backward_bytes),
            Phase.OPTIMIZER: peak(Phase.OPTIMIZER, 4 * GIB),
        },
    )


def test_stale_gradients_saves_down_to_the_next_phase() -> None:
    advice = stale_gradients(forward_peak_summary(7 * GIB + 512 * MIB), healthy_setup())
    assert advice is not None
    assert advice.estimated_saving_bytes == 512 * MIB  # gradients are 1 GiB, but backward then peaks 0.5 GiB lower
    assert "in forward of step 5, with 1.00 GiB of gradients alive" in advice.evidence
    assert "batch_idx % self.trainer.accumulate_grad_batches == 0" in advice.detail


def test_stale_gradients_near_misses() -> None:
    assert stale_gradients(forward_peak_summary(8 * GIB - 100 * MIB), healthy_setup()) is None  # 1.2% of the peak
    assert stale_gradients(forward_peak_summary(7 * GIB), healthy_setup(automatic_optimization=False)) is None
    assert stale_gradients(healthy_summary(), healthy_setup()) is None  # the peak is in backward


def test_optimizer_state_lists_options_largest_first() -> None:
    state_heavy = replace(HEALTHY_BREAKDOWN, optimizer_state=4 * GIB, activations=GIB, other=GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, state_heavy))
    advice = optimizer_state(summary, healthy_setup(optimizers=("AdamW",)))
    assert advice is not None
    assert advice.estimated_saving_bytes == 3 * GIB  # 8-bit Adam keeps a quarter
    assert advice.detail.index("8-bit Adam") < advice.detail.index("SGD with momentum")
    assert "optimizer state (AdamW) is 4.00 GiB, 50.0% of the backward peak" in advice.evidence
    sharded = optimizer_state(summary, healthy_setup(optimizers=("SGD",), world_size=4))
    assert sharded is not None and sharded.estimated_saving_bytes == 3 * GIB  # 3/4 of it lives on other devices


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_optimizer_state_already_sharded(strategy: str) -> None:
    state_heavy = replace(HEALTHY_BREAKDOWN, optimizer_state=4 * GIB, activations=GIB, other=GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, state_heavy))
    adam = optimizer_state(summary, healthy_setup(optimizers=("AdamW",), world_size=4, strategy=strategy))
    assert adam is not None and adam.estimated_saving_bytes == 3 * GIB  # 8-bit Adam, not sharding again
    assert "shard" not in adam.detail + adam.title and "fsdp" not in adam.detail
    assert optimizer_state(summary, healthy_setup(optimizers=("SGD",), world_size=4, strategy=strategy)) is None


def test_optimizer_state_near_miss() -> None:
    almost = replace(HEALTHY_BREAKDOWN, optimizer_state=3 * GIB - 1)  # just under the activations
    assert optimizer_state(healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, almost)), healthy_setup()) is None


def test_large_linear() -> None:
    head = LinearLayer("head", 65536, 4096, 644 * MIB)
    advice = large_linear(healthy_summary(), healthy_setup(parameter_bytes=GIB, linear_layers=(head,)))
    assert advice is not None
    assert advice.estimated_saving_bytes == int(644 / 1024 * 3 * GIB)  # its share of parameters+gradients+state
    assert "head: Linear(65536 -> 4096) has 644.0 MiB of 1.00 GiB parameters" in advice.evidence
    half = LinearLayer("head", 65536, 4096, 512 * MIB)
    assert large_linear(healthy_summary(), healthy_setup(linear_layers=(half,))) is None


def test_allocator_fragmentation() -> None:
    fragmented = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, reserved=11 * GIB))
    advice = allocator_fragmentation(fragmented, healthy_setup())
    assert advice is not None
    assert advice.estimated_saving_bytes == 3 * GIB
    assert "reserved 11.00 GiB at the peak while 8.00 GiB were allocated (3.00 GiB cached, 27.3%" in advice.evidence
    within = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, reserved=10 * GIB + 512 * MIB))  # 23.8%
    assert allocator_fragmentation(within, healthy_setup()) is None
    assert allocator_fragmentation(replace(within, alloc_retries=2), healthy_setup()) is not None


def headroom_summary(**changes: Any) -> RunSummary:
    small = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=GIB, activations=600 * MIB, other=424 * MIB)
    return healthy_summary(**{"peak": peak(Phase.BACKWARD, 4 * GIB, small), "gpu_utilization_mean": 40.0, **changes})


def test_batch_size_headroom_predicts_the_batch() -> None:
    advice = batch_size_headroom(headroom_summary(), healthy_setup())
    assert advice is not None
    # Per sample (600 + 424) MiB / 32 = 32 MiB; fixed 3 GiB + 300 MiB context; 90% of 16 GiB usable.
    expected = int((0.9 * 16 * GIB - 3 * GIB - 300 * MIB) // (32 * MIB))
    assert f"A batch of up to {expected} should fit (now 32)" in advice.title
    assert "GPU utilization 40%" in advice.evidence


def test_batch_size_headroom_near_misses() -> None:
    assert batch_size_headroom(headroom_summary(gpu_utilization_mean=75.0), healthy_setup()) is None
    assert batch_size_headroom(headroom_summary(gpu_utilization_mean=None), healthy_setup()) is None  # no NVML
    assert batch_size_headroom(headroom_summary(data_wait_fraction=0.2), healthy_setup()) is None
    assert batch_size_headroom(headroom_summary(device=CPU), healthy_setup()) is None


def test_fit_table_for_common_gpus() -> None:
    rows = fit_table(headroom_summary())
    assert [row.device for row in rows] == [name for name, _ in COMMON_GPUS]
    for row, (_, capacity) in zip(rows, COMMON_GPUS, strict=True):
        assert row.max_batch_size == max(int((0.9 * capacity - 3 * GIB - 300 * MIB) // (32 * MIB)), 0)
    assert fit_table(headroom_summary(device=CPU)) == ()


def test_near_capacity_ranks_remedies() -> None:
    full = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=8 * GIB, other=3 * GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB, full, reserved=15 * GIB + 256 * MIB))
    advice = near_capacity(summary, healthy_setup(precision="32-true"))
    assert advice is not None
    assert advice.severity == "critical"
    assert "(93.8% of the device)" in advice.title
    # Halving the batch frees half of activations + other (5.5 GiB); AMP half of the activations (4 GiB).
    assert advice.detail.index("halve the batch to 16") < advice.detail.index("mixed-precision")
    assert advice.estimated_saving_bytes == 11 * GIB // 2
    assert near_capacity(healthy_summary(peak=peak(Phase.BACKWARD, 14 * GIB, full)), healthy_setup()) is None
    assert advise(summary, healthy_setup(precision="32-true"))[0].id == "near-capacity"
