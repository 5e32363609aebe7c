"""Each rule on hand-built summaries: it fires with the right evidence and saving, and stays silent on the near miss."""

from __future__ import annotations

from dataclasses import replace

import pytest
from advice_summaries import (
    CPU,
    GIB,
    GPU,
    HEALTHY_BREAKDOWN,
    MIB,
    blocks,
    forward_peak_summary,
    headroom_summary,
    healthy_setup,
    healthy_summary,
    leaky_relu,
    peak,
)

from lightning_vram.advice import checkpointing
from lightning_vram.advice.capacity import fit_table
from lightning_vram.advice.checkpointing import best_checkpoint_plan
from lightning_vram.advice.rules.activation_checkpointing import activation_checkpointing
from lightning_vram.advice.rules.allocator_fragmentation import allocator_fragmentation
from lightning_vram.advice.rules.batch_size_headroom import batch_size_headroom
from lightning_vram.advice.rules.dataloader_workers import dataloader_workers
from lightning_vram.advice.rules.inplace_activations import inplace_activations
from lightning_vram.advice.rules.large_linear import large_linear
from lightning_vram.advice.rules.mixed_precision import mixed_precision
from lightning_vram.advice.rules.near_capacity import near_capacity
from lightning_vram.advice.rules.optimizer_state import optimizer_state
from lightning_vram.advice.rules.pin_memory import pin_memory
from lightning_vram.advice.rules.registry import advise, not_advised
from lightning_vram.advice.rules.stale_gradients import stale_gradients
from lightning_vram.prediction.devices import COMMON_GPUS
from lightning_vram.records import (
    Breakdown,
    LinearLayer,
    ModuleProfile,
    Phase,
    TrainingLoop,
)


def test_a_healthy_run_gets_no_advice() -> None:
    assert advise(healthy_summary(), healthy_setup()) == ()


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
    assert "return checkpoint_keeping_buffers([self.block, *self.then], self._run, *args, **kwargs)" in advice.detail
    assert "self.encoder.layers[index] = Checkpointed(self.encoder.layers[index])" in advice.detail


def test_activation_checkpointing_near_misses() -> None:
    modules = blocks(4, 750 * MIB, 64 * MIB)
    other_larger = replace(HEALTHY_BREAKDOWN, other=4 * GIB)  # activations no longer the largest part
    summary = healthy_summary(modules=modules, peak=peak(Phase.BACKWARD, 9 * GIB, other_larger))
    assert activation_checkpointing(summary, healthy_setup()) is None
    # Blocks whose input is as large as what they save free nothing.
    assert activation_checkpointing(healthy_summary(modules=blocks(4, 200 * MIB, 200 * MIB)), healthy_setup()) is None


def test_checkpoint_sequential_splits_as_torch_does() -> None:
    # An nn.Sequential of 4 layers saving 100 MiB each, 10 MiB inputs (not saved by the layers). torch gives each of
    # the first segments len // segments layers. 2 segments: forward keeps 10 MiB + the last segment's 200 MiB, and
    # recomputing the first holds 10 + 200: 190 MiB of 400 saved. 4 segments (one layer each, the last not
    # checkpointed): forward keeps 3 x 10 + 100, recomputing layer 2 holds 20 + 10 + 100: 270 MiB saved.
    layers = tuple(ModuleProfile(f"net.{index}", "Block", 100 * MIB, input_bytes=10 * MIB) for index in range(4))
    plan = best_checkpoint_plan((ModuleProfile("net", "Sequential", 0, input_bytes=10 * MIB), *layers))
    assert plan is not None
    assert (plan.sequential_segments, plan.saving_bytes) == (4, 270 * MIB)
    assert plan.units == (("net.0",), ("net.1",), ("net.2",))
    two = best_checkpoint_plan((ModuleProfile("net", "Sequential", 0), *layers[:2]))
    assert two is not None and two.saving_bytes == 90 * MIB  # peak max(10 + 100, 10 + 100) = 110 MiB of 200
    assert best_checkpoint_plan((ModuleProfile("net", "Sequential", 0), layers[0])) is None  # one child: nothing


def resnet_profiles() -> tuple[ModuleProfile, ...]:
    """A ResNet's sampled step, in MiB: stem conv-BN-ReLU(inplace), two stages, pooling and a head.

    The conv saves its input (the batch), BatchNorm its input and its statistics, the inplace ReLU its result (its
    input's storage); each stage's first conv saves the stage's input (the ReLU saved it first) and its last
    inplace ReLU its output.
    """

    def stage(name: str) -> ModuleProfile:
        return ModuleProfile(
            name,
            "Sequential",
            200 * MIB,
            input_bytes=40 * MIB,
            output_bytes=40 * MIB,
            input_saved_for_backward=True,
            input_saved_bytes=40 * MIB,
            output_saved_bytes=40 * MIB,
        )

    return (
        ModuleProfile("network", "ResNet", 0, input_bytes=10 * MIB, input_saved_bytes=10 * MIB),
        ModuleProfile("network.conv1", "Conv2d", 10 * MIB, input_bytes=10 * MIB, input_saved_bytes=10 * MIB),
        ModuleProfile("network.bn1", "BatchNorm2d", 50 * MIB, input_bytes=40 * MIB, input_saved_bytes=40 * MIB),
        ModuleProfile(
            "network.relu",
            "ReLU",
            40 * MIB,
            input_bytes=40 * MIB,
            output_bytes=40 * MIB,
            inplace=True,
            input_saved_bytes=40 * MIB,
            output_saved_bytes=40 * MIB,
        ),
        stage("network.layer1"),
        stage("network.layer2"),
        ModuleProfile("network.avgpool", "AdaptiveAvgPool2d", 0, input_bytes=40 * MIB, input_saved_for_backward=True),
        ModuleProfile("network.fc", "Linear", MIB, input_bytes=MIB, input_saved_bytes=MIB),
        ModuleProfile("(training_step)", "-", MIB),
    )


def test_checkpoint_units_never_start_with_an_inplace_op() -> None:
    # Checkpointing the stem's inplace relu alone overwrites the input its checkpoint keeps: backward raises. It
    # joins bn1's unit. Units bn1+relu, layer1, layer2 checkpointed (avgpool saves nothing, fc is last): forward
    # keeps 10 (conv1's input) + 4 x 40 (the units' inputs and layer2's output, avgpool's input) + 1 (fc's) + 1
    # (loss) = 172 MiB; recomputing layer2 holds 10 + 40 + 40 + 40 kept and its 160 + 40 again: 330 MiB, the peak,
    # of 502: 172 MiB saved. Adding conv1 saves no more.
    plan = best_checkpoint_plan(resnet_profiles())
    assert plan is not None
    assert plan.units == (
        ("network.bn1", "network.relu"),
        ("network.layer1",),
        ("network.layer2",),
    )  # avgpool saves nothing: never a unit
    assert (plan.container, plan.forward_of, plan.saving_bytes) == ("network", "network", 172 * MIB)
    activations = Breakdown(
        parameters=30 * MIB, gradients=30 * MIB, optimizer_state=30 * MIB, activations=502 * MIB, other=8 * MIB
    )
    summary = healthy_summary(modules=resnet_profiles(), peak=peak(Phase.FORWARD, 600 * MIB, activations))
    advice = activation_checkpointing(summary, healthy_setup())
    # The run's peak falls less: recomputing layer2 holds its 330 MiB with the 90 of parameters, gradients and
    # optimizer state, and the gradients flowing out of and into it (its output's and its input's, 40 + 40): 500 of
    # the 600 MiB peak, 100 MiB saved.
    assert advice is not None and advice.estimated_saving_bytes == 100 * MIB
    assert "# in the forward of `network`" in advice.detail
    assert "x = checkpoint_keeping_buffers([self.bn1, self.relu], lambda t: self.relu(self.bn1(t)), x)" in advice.detail
    assert "x = checkpoint_keeping_buffers([self.layer1], self.layer1, x)" in advice.detail
    assert "self.fc" not in advice.detail


def test_checkpoint_sequential_skips_segments_that_start_inplace() -> None:
    # conv, relu_, conv, relu_, conv, relu_ in MiB: each conv saves its input (10) and 20 more, each relu_ its
    # result (10). With 4, 5 or 6 segments a checkpointed segment starts with a relu_: not proposed. 2 segments:
    # forward keeps 10 + the last segment's 40; recomputing the first holds 10 + 50: 60 of 100. 3 segments also
    # peak at 60; the tie goes to fewer checkpointed modules.
    layers = []
    for index in range(3):
        conv_saves = 30 * MIB if index == 0 else 20 * MIB
        layers.append(
            ModuleProfile(
                f"net.{2 * index}",
                "Conv2d",
                conv_saves,
                input_bytes=10 * MIB,
                input_saved_for_backward=index > 0,
                input_saved_bytes=10 * MIB,
            )
        )
        layers.append(
            ModuleProfile(
                f"net.{2 * index + 1}",
                "ReLU",
                10 * MIB,
                input_bytes=10 * MIB,
                inplace=True,
                input_saved_bytes=10 * MIB,
                output_saved_bytes=10 * MIB,
            )
        )
    plan = best_checkpoint_plan((ModuleProfile("net", "Sequential", 0), *layers))
    assert plan is not None
    assert (plan.sequential_segments, plan.units, plan.saving_bytes) == (2, (("net.0", "net.1", "net.2"),), 40 * MIB)
    assert plan.forward_of == ""


def test_a_modulelist_plan_is_written_in_the_forward_that_loops() -> None:
    # model.layers is an nn.ModuleList: never called, its blocks are, in model's forward. Blocks save 100 MiB, of
    # which their 10 MiB input; the embedding before saves 5, the head after 1. All four checkpointed: forward
    # keeps 5 + 4 x 10 + 1, recomputing the last block holds 5 + 40 + 90: 135 of 406 -> 271 MiB saved.
    blocks = tuple(
        ModuleProfile(f"model.layers.{index}", "Block", 100 * MIB, input_bytes=10 * MIB, input_saved_bytes=10 * MIB)
        for index in range(4)
    )
    profiles = (
        ModuleProfile("model", "Encoder", 0),
        ModuleProfile("model.embed", "Embedding", 5 * MIB),
        *blocks,
        ModuleProfile("model.head", "Linear", MIB),
    )
    plan = best_checkpoint_plan(profiles)
    assert plan is not None
    assert (plan.container, plan.forward_of, plan.saving_bytes) == ("model.layers", "model", 271 * MIB)
    summary = healthy_summary(
        modules=profiles,
        peak=peak(Phase.FORWARD, GIB, replace(HEALTHY_BREAKDOWN, parameters=0, gradients=0, optimizer_state=0)),
    )
    advice = activation_checkpointing(summary, healthy_setup())
    assert advice is not None
    # A wrapper in place of each block: the loop in the forward of `model` calls them as before, every argument passed.
    assert "for index in range(0, 4):\n    self.model.layers[index] = Checkpointed(self.model.layers[index])" in (
        advice.detail
    )


def test_plan_peak_without_checkpoints_is_what_was_saved() -> None:
    # Each boundary storage between two units counted once, whichever unit saved it first.
    profiles = resnet_profiles()
    groups = [["network.conv1"], ["network.bn1", "network.relu"], *[[profile.name] for profile in profiles[4:-1]]]
    indexed = checkpointing.ProfileIndex(profiles)
    units = [indexed.unit(group) for group in groups]
    outside = indexed.outside(groups)
    assert outside == (0, MIB, (None,) * len(groups))
    assert checkpointing.plan_peak(units, [False] * len(units), *outside) == 502 * MIB


def test_inplace_activations_promises_the_saved_input_it_merges() -> None:
    # Out of place, LeakyReLU saves its input and the next op its output; leaky_relu_ computes its gradient from
    # its result: one tensor instead of two, the input's bytes saved.
    leaky = leaky_relu()
    second = replace(leaky, name="body.3", activation_bytes=100 * MIB, input_saved_bytes=100 * MIB)
    unsafe = replace(leaky, name="body.5", input_saved_for_backward=True)
    setup = healthy_setup(inplace_keeps_result=("body.1", "body.3", "body.5"))
    advice = inplace_activations(healthy_summary(modules=(leaky, second, unsafe)), setup)
    assert advice is not None
    assert advice.estimated_saving_bytes == 300 * MIB
    assert "2 activation module(s) run out of place (LeakyReLU)" in advice.evidence
    assert "300.0 MiB of saved inputs, 3.7% of the peak (largest body.1, 200.0 MiB)" in advice.evidence
    assert "autograd saved their input for an earlier op: body.5" in advice.evidence
    assert "residual connection" in advice.detail


def test_inplace_activations_near_misses() -> None:
    leaky = leaky_relu()
    setup = healthy_setup(inplace_keeps_result=("body.1",))
    assert inplace_activations(healthy_summary(modules=(leaky,)), setup) is not None
    # ReLU saves its output, not its input: inplace keeps the same saved tensor (the old advice promised its output).
    relu = replace(leaky, type="ReLU", input_saved_bytes=0, output_saved_bytes=200 * MIB)
    assert inplace_activations(healthy_summary(modules=(relu,)), setup) is None
    # Its inplace variant keeps a copy of the input (SiLU, Hardtanh): not in inplace_keeps_result.
    assert inplace_activations(healthy_summary(modules=(leaky,)), healthy_setup()) is None
    # Nothing saves its output: out of place it keeps one tensor already.
    alone = replace(leaky, output_saved_for_backward=False)
    assert inplace_activations(healthy_summary(modules=(alone,)), setup) is None
    small = replace(leaky, input_saved_bytes=150 * MIB)  # 1.8% of 8 GiB
    assert inplace_activations(healthy_summary(modules=(small,)), setup) is None
    dropout = replace(leaky, type="Dropout")
    assert inplace_activations(healthy_summary(modules=(dropout,)), setup) is None


@pytest.mark.parametrize(
    ("capability", "precision"), [((8, 0), "bf16-mixed"), ((9, 0), "bf16-mixed"), ((7, 5), "16-mixed")]
)
def test_mixed_precision_without_a_replay_promises_speed_not_memory(
    capability: tuple[int, int], precision: str
) -> None:
    # Autocast does not halve activations (DOMAIN.md: a GPT-2-class model's went up): without a replay of the step
    # in 16 bits, no memory saving is estimated at all; tensor cores are the reason to change.
    summary = healthy_summary(device=replace(GPU, compute_capability=capability))
    advice = mixed_precision(summary, healthy_setup(precision="32-true"))
    assert advice is not None
    assert advice.title == f'Train with precision="{precision}" to run matmuls on tensor cores'
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (None, None, None)
    assert "No memory saving is promised: the step was not replayed in" in advice.detail
    assert "half" not in (advice.title + advice.detail + advice.evidence).lower()
    assert f"training in 32-true on NVIDIA A100 (compute capability {capability[0]}.{capability[1]}: tensor cores)" in (
        advice.evidence
    )


def test_mixed_precision_near_misses() -> None:
    assert mixed_precision(healthy_summary(), healthy_setup(precision="16-mixed")) is None
    assert mixed_precision(healthy_summary(device=CPU), healthy_setup(precision="32-true")) is None
    # No tensor cores (Pascal) and no replay showing a memory saving: nothing measured speaks for it.
    pascal = healthy_summary(device=replace(GPU, compute_capability=(6, 1)))
    assert mixed_precision(pascal, healthy_setup(precision="32-true")) is None
    unknown = healthy_summary(device=replace(GPU, compute_capability=None))
    assert mixed_precision(unknown, healthy_setup(precision="32-true")) is None


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
    # The printed line keeps the user's own arguments (before: `DataLoader(dataset, batch_size=..., num_workers=7,
    # persistent_workers=True)`, which, pasted, dropped shuffle=True, a sampler or a collate_fn: other data, in
    # another order).
    assert "DataLoader(dataset, ..., num_workers=7, persistent_workers=True, pin_memory=True)  # `...`: your own" in (
        advice.detail
    )
    assert "keep every other as it is: shuffle, sampler, collate_fn and drop_last" in advice.detail


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


def test_stale_gradients_saves_down_to_the_next_phase() -> None:
    advice = stale_gradients(forward_peak_summary(7 * GIB + 512 * MIB), healthy_setup())
    assert advice is not None
    assert advice.estimated_saving_bytes == 512 * MIB  # gradients are 1 GiB, but backward then peaks 0.5 GiB lower
    assert "in forward of step 5, with 1.00 GiB of gradients alive" in advice.evidence
    assert "batch_idx % trainer.accumulate_grad_batches == 0" in advice.detail
    assert "callbacks=[FreeGradientsBeforeForward(), VramMonitor()]" in advice.detail


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
    # AdamW's decoupled weight decay is not Adam8bit's L2 penalty: the 8-bit optimizer with the run's own update.
    assert "bitsandbytes.optim.AdamW8bit" in advice.detail  # before: bitsandbytes.optim.Adam8bit
    adam = optimizer_state(summary, healthy_setup(optimizers=("Adam",)))
    assert adam is not None and "bitsandbytes.optim.Adam8bit" in adam.detail
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


def vgg_head(feature_map: tuple[int, int] | None) -> ModuleProfile:
    return ModuleProfile("classifier.0", "Linear", 0, input_feature_map=feature_map)


def test_large_linear_saves_the_pooled_weights_with_their_state() -> None:
    # VGG's first Linear(512 * 7 * 7, 4096) reads a flattened 512 x 49 map: pooled, Linear(512, 4096) keeps 1/49
    # of the 392 MiB weight. Parameters, gradients and state are 3 GiB for 1 GiB of parameters: 3x.
    weight = 4096 * 512 * 49 * 4
    head = LinearLayer("classifier.0", 512 * 49, 4096, weight + 4096 * 4, weight)
    summary = healthy_summary(modules=(vgg_head((512, 49)),))
    advice = large_linear(summary, healthy_setup(linear_layers=(head,)))
    assert advice is not None
    assert advice.estimated_saving_bytes == 3 * (weight - weight // 49)
    assert "Linear(25088, 4096) becomes Linear(512, 4096)" in advice.detail
    assert "map of 512 channels x 49 positions; its weight is 392.0 MiB, pooling removes 384.0 MiB" in advice.evidence


def test_large_linear_near_misses() -> None:
    weight = 4096 * 512 * 49 * 4
    head = LinearLayer("classifier.0", 512 * 49, 4096, weight, weight)
    setup = healthy_setup(linear_layers=(head,))
    # A Linear reading anything but a convolutional map (an MLP's first layer, a language model's lm_head).
    assert large_linear(healthy_summary(modules=(vgg_head(None),)), setup) is None
    # Already pooled to one position.
    assert large_linear(healthy_summary(modules=(vgg_head((25088, 1)),)), setup) is None
    # Its weight is tied to another module: no bytes of its own.
    tied = replace(head, parameter_bytes=0, weight_bytes=0)
    assert large_linear(healthy_summary(modules=(vgg_head((512, 49)),)), healthy_setup(linear_layers=(tied,))) is None
    # A small map: 2 x 2 positions of a 16 MiB weight save 3 x 12 MiB, under 5% of the 8 GiB peak.
    small = replace(head, in_features=4096 * 4, weight_bytes=16 * MIB)
    assert large_linear(healthy_summary(modules=(vgg_head((4096, 4)),)), healthy_setup(linear_layers=(small,))) is None


def test_allocator_fragmentation() -> None:
    fragmented = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, reserved=11 * GIB))
    advice = allocator_fragmentation(fragmented, healthy_setup())
    assert advice is not None
    assert advice.estimated_saving_bytes == 3 * GIB
    assert "reserved 11.00 GiB at the peak while 8.00 GiB were allocated (3.00 GiB cached, 27.3%" in advice.evidence
    within = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, reserved=10 * GIB + 512 * MIB))  # 23.8%
    assert allocator_fragmentation(within, healthy_setup()) is None
    assert allocator_fragmentation(replace(within, alloc_retries=2), healthy_setup()) is not None


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
    # Halving the batch frees half of activations + other (5.5 GiB), modelled. Mixed precision promises no memory
    # without a replay, so it is no remedy here.
    assert advice.detail == (
        "Remedies this run's measurements support, largest saving first: halve the batch to 16 (with"
        " accumulate_grad_batches=2): about 5.50 GiB (modelled). Half the batch with accumulate_grad_batches=2"
        " sums the gradients of two halves: the same as the whole batch's up to float32 rounding (about 1e-6"
        " relative) where the loss is a mean over the batch's samples (a mean over the tokens ignore_index keeps,"
        " whose count differs between the halves, a summed loss, which the accumulation halves, or a loss comparing"
        " the batch's samples, in-batch negatives, trains another model)."
    )
    assert (advice.estimated_saving_bytes, advice.saving_basis) == (11 * GIB // 2, "modelled")
    assert near_capacity(healthy_summary(peak=peak(Phase.BACKWARD, 14 * GIB, full)), healthy_setup()) is None
    assert advise(summary, healthy_setup(precision="32-true"))[0].id == "near-capacity"


@pytest.mark.parametrize("options", [{"ignore_index": 0}, {"reduction": "sum"}])
def test_halved_batch_says_which_losses_two_halves_do_not_reproduce(options: dict[str, object]) -> None:
    # Two halves, each loss divided by 2 as Lightning's accumulation does, against the whole batch: a padded batch's
    # mean over the tokens ignore_index keeps weighs each half's tokens by its own count, a sum is halved.
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    hidden, targets = torch.randn(8, 16, 8, generator=generator), torch.randint(1, 50, (8, 16), generator=generator)
    targets[::3, 4:] = 0  # padding, uneven between the halves

    def gradient(halves: bool) -> torch.Tensor:
        head.zero_grad()
        parts = [(hidden[:4], targets[:4]), (hidden[4:], targets[4:])] if halves else [(hidden, targets)]
        loss = sum(F.cross_entropy(head(h).flatten(0, 1), t.flatten(), **options) for h, t in parts)  # type: ignore[arg-type]
        (loss / len(parts)).backward()
        assert head.weight.grad is not None
        return head.weight.grad.clone()

    whole, halved = gradient(False), gradient(True)
    assert (halved - whole).abs().max().item() > 0.05 * whole.abs().max().item()  # seen: 10.0% and 50%
    full = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=8 * GIB, other=3 * GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB, full, reserved=15 * GIB + 256 * MIB))
    advice = near_capacity(summary, healthy_setup(precision="32-true"))
    assert advice is not None
    # Before: "the same as the whole batch's up to float32 rounding", whatever the loss.
    assert (
        "where the loss is a mean over the batch's samples (a mean over the tokens ignore_index keeps" in advice.detail
    )
    assert "a summed loss, which the accumulation halves" in advice.detail


def test_halved_batch_accumulates_where_the_loop_can() -> None:
    # Under manual optimization Lightning refuses Trainer(accumulate_grad_batches=2) at fit (before, printed as the
    # remedy); a plain loop has no such setting: the accumulation is the user's own.
    full = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=8 * GIB, other=3 * GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB, full, reserved=15 * GIB + 256 * MIB))
    manual = near_capacity(summary, healthy_setup(precision="32-true", automatic_optimization=False))
    assert manual is not None and "accumulate_grad_batches=2" not in manual.detail
    assert (
        "halve the batch to 16 (accumulating the gradients of 2 such batches per optimizer step, each loss divided by"
        " 2, in training_step: Lightning refuses accumulate_grad_batches under manual optimization)"
    ) in manual.detail
    plain = near_capacity(summary, healthy_setup(precision="32-true", loop=TrainingLoop.PLAIN))
    assert plain is not None and "each loss divided by 2, in your loop)" in plain.detail


def test_dataloader_workers_needs_a_spare_core_per_device_and_says_why() -> None:
    # A new user's DDP run (2 ranks on 2 cores) waited 32.1% of its steps for an in-memory dataset and was told to
    # add a worker, which would share its rank's only core; other runs of the same set-up waited 1.3% to 2.8%.
    starved = healthy_summary(data_wait_fraction=0.321, recent_data_wait_fraction=0.3, timed_steps=50)
    one_core = healthy_setup(num_workers=0, cpu_cores_per_device=1, world_size=2)
    assert dataloader_workers(starved, one_core) is None
    reasons = {item.id: item.reason for item in not_advised(starved, one_core, None, ())}
    assert reasons["dataloader-workers"] == (
        "more DataLoader workers: data wait is 32.1% of step time, but the machine has 1 CPU core per device: no"
        " spare core for a worker, which would share the training process's core (the wait may be processes"
        " contending for cores, not loading)"
    )
    two_cores = dataloader_workers(starved, replace(one_core, cpu_cores_per_device=2))  # one spare: one worker
    assert two_cores is not None and "DataLoader(num_workers=1, persistent_workers=True)" in two_cores.title
