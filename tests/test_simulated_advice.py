"""Advice read from the step replay: each rule on hand-built simulations, the report's simulation section, and each
simulated rule applied for real on the CPU, its measured saving within 10% of the replayed one.

Hand-built replays are CUDA replays (their peaks are the allocator's ``peak_bytes``); the applied tests replay on
the CPU, where a peak is the sum of the counted parts, as the CPU report measures it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import LanguageModel, TinyGPT, activation_mlp, apply_plan, features, tokens
from advice_summaries import (
    CPU,
    GPU,
    HEALTHY_BREAKDOWN,
    blocks,
    forward_peak_summary,
    headroom_summary,
    healthy_setup,
    healthy_summary,
    leaky_relu,
    peak,
)
from models import OPTIMIZERS, Classifier, loader, trainer
from replay_models import images, resnet
from torch import nn
from torch.utils.data import Dataset

from lightning_vram import Report, VramMonitor
from lightning_vram._lightning import trainer_setup
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.replay.simulation import simulate
from lightning_vram.advice.report import build_report
from lightning_vram.advice.rules import (
    FULL_PRECISIONS,
    activation_checkpointing,
    advise,
    allocator_fragmentation,
    batch_size_headroom,
    checkpoint_snippet,
    chunked_loss,
    dataloader_workers,
    fit_table,
    inplace_activations,
    inplace_candidates,
    large_linear,
    mixed_precision,
    near_capacity,
    optimizer_state,
    pin_memory,
    stale_gradients,
)
from lightning_vram.codec import FormatError, report_from_dict
from lightning_vram.records import (
    Advice,
    BaselineMatch,
    BatchSizeChange,
    Breakdown,
    CheckpointChange,
    DeviceInfo,
    FitRow,
    FreeGradientsChange,
    InplaceChange,
    LinearLayer,
    PartMatch,
    Phase,
    PhasePeak,
    PrecisionChange,
    ReplayedStep,
    RunSummary,
    Simulation,
    StepChange,
    TrainingSetup,
    VariantResult,
)
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown, summary_text

GIB = 1024**3
MIB = 1024**2
BROKEN = "RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation"

# ------------------------------------------------------------------------------------------------ hand-built replays


def step(
    forward: int,
    backward: int,
    optimizer: int = 4 * GIB,
    *,
    breakdowns: dict[Phase, Breakdown] | None = None,
    loss_bytes: int = 0,
    device: str = "cuda",
) -> ReplayedStep:
    """A replayed step of step 5 with these allocator peaks per phase."""
    given = breakdowns or {}
    peaks = {Phase.FORWARD: forward, Phase.BACKWARD: backward, Phase.OPTIMIZER: optimizer}
    phases = {
        phase: PhasePeak(5, phase, total, None, given.get(phase, HEALTHY_BREAKDOWN)) for phase, total in peaks.items()
    }
    return ReplayedStep(device, "32-true", 32, phases, (), loss_bytes, 0.25)


BASELINE = step(7 * GIB, 8 * GIB)
"""The healthy summary's step, replayed: 7, 8 and 4 GiB, the peak in backward."""


def test_replayed_peaks_are_read_as_the_report_measures_them() -> None:
    # On CUDA the allocator's (every live tensor); on the CPU the counted parts, as the CPU report's peaks are.
    cuda, cpu = step(9 * GIB, 8 * GIB), step(9 * GIB, 8 * GIB, device="cpu")
    assert (cuda.reported_peak.phase, cuda.reported_bytes(cuda.reported_peak)) == (Phase.FORWARD, 9 * GIB)
    assert cpu.reported_bytes(cpu.phases[Phase.BACKWARD]) == HEALTHY_BREAKDOWN.counted_bytes == 6 * GIB
    assert cpu.reported_peak.phase is Phase.FORWARD  # a tie goes to the first phase


def simulated(*variants: VariantResult, baseline: ReplayedStep = BASELINE, **fields: Any) -> Simulation:
    return Simulation(baseline.device_type, baseline, None, None, variants, 1.5, **fields)


def replayed(change: StepChange, peak_bytes: int, phase: Phase = Phase.BACKWARD) -> VariantResult:
    """``change`` replayed with its peak ``peak_bytes`` in ``phase``; the other phases 1 GiB lower at most."""
    others = {Phase.FORWARD: peak_bytes - GIB, Phase.BACKWARD: peak_bytes - GIB, Phase.OPTIMIZER: 4 * GIB}
    others[phase] = peak_bytes
    return VariantResult(
        change, step(others[Phase.FORWARD], others[Phase.BACKWARD], min(others[Phase.OPTIMIZER], peak_bytes))
    )


def discarded(change: StepChange, reason: str = BROKEN) -> VariantResult:
    return VariantResult(change, None, reason)


def text_of(advice: Advice) -> str:
    return f"{advice.title}\n{advice.detail}\n{advice.evidence}"


# ---------------------------------------------------------------------------------------- activation-checkpointing


def checkpoint_summary() -> RunSummary:
    # Four 750 MiB blocks with 64 MiB inputs: the modelled best plan frees (3000 - 942) MiB of the 8 GiB peak.
    return healthy_summary(modules=blocks(4, 750 * MIB, 64 * MIB))


def test_checkpointing_advises_the_replayed_saving() -> None:
    summary = checkpoint_summary()
    plans = checkpoint_candidates(summary.modules)
    assert len(plans) == 3 and plans[0].saving_bytes == (3000 - 942) * MIB
    advice = activation_checkpointing(
        summary, healthy_setup(), simulated(replayed(CheckpointChange(plans[0]), 6 * GIB))
    )
    assert advice is not None
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        2 * GIB,
        "simulated",
        6 * GIB,
    )
    assert (
        advice.title
        == "Checkpoint 3 units of `encoder.layers`, `encoder.layers.0` to `encoder.layers.2` to free about 2.00 GiB"
    )
    assert (
        f"replayed on this run's step, {CheckpointChange(plans[0]).label} takes the allocator peak from 8.00 GiB in"
        " backward to 6.00 GiB in backward" in advice.evidence
    )
    assert checkpoint_snippet(plans[0])[1] in advice.detail


def test_checkpointing_under_the_threshold_when_replayed_is_silent() -> None:
    summary = checkpoint_summary()
    plan = checkpoint_candidates(summary.modules)[0]
    assert activation_checkpointing(summary, healthy_setup()) is not None  # modelled: 2 GiB of 8
    # Replayed, it frees 0.5 GiB of 8: under a tenth of the peak.
    small = simulated(replayed(CheckpointChange(plan), 7 * GIB + 512 * MIB))
    assert activation_checkpointing(summary, healthy_setup(), small) is None


def test_a_plan_whose_replay_raised_is_never_advised() -> None:
    summary = checkpoint_summary()
    first, second, third = checkpoint_candidates(summary.modules)
    runner_up = simulated(discarded(CheckpointChange(first)), replayed(CheckpointChange(second), 6 * GIB + 512 * MIB))
    advice = activation_checkpointing(summary, healthy_setup(), runner_up)
    assert advice is not None and advice.estimated_saving_bytes == 3 * GIB // 2
    assert checkpoint_snippet(second)[1] in advice.detail and checkpoint_snippet(first)[1] not in advice.detail
    assert f"not advised, its replay raised: {CheckpointChange(first).label} (RuntimeError: one of" in advice.evidence
    every = simulated(*(discarded(CheckpointChange(plan)) for plan in (first, second, third)))
    assert activation_checkpointing(summary, healthy_setup(), every) is None
    # Some discarded, the rest not replayed: none is known to work, none is advised.
    assert activation_checkpointing(summary, healthy_setup(), simulated(discarded(CheckpointChange(first)))) is None


def test_checkpointing_picks_the_plan_whose_replay_saves_most() -> None:
    summary = checkpoint_summary()
    first, second, _ = checkpoint_candidates(summary.modules)
    # The variant's plan carries another modelled saving (profiles of another sampled step): the same plan.
    both = simulated(
        replayed(CheckpointChange(replace(first, saving_bytes=1)), 7 * GIB),
        replayed(CheckpointChange(second), 6 * GIB),
    )
    advice = activation_checkpointing(summary, healthy_setup(), both)
    assert advice is not None and advice.estimated_saving_bytes == 2 * GIB
    assert checkpoint_snippet(second)[1] in advice.detail


def test_checkpointing_without_a_usable_replay_keeps_the_modelled_saving() -> None:
    summary = checkpoint_summary()
    plan = checkpoint_candidates(summary.modules)[0]
    modelled = (plan.saving_bytes, "modelled", None)
    out_of_time = discarded(CheckpointChange(plan), "not replayed: the time budget of 30.0 s ran out")
    mismatched = replace(simulated(replayed(CheckpointChange(plan), 7 * GIB)), skipped="the replay does not match")
    for simulation in (None, simulated(), simulated(out_of_time), mismatched):
        advice = activation_checkpointing(summary, healthy_setup(), simulation)
        assert advice is not None
        assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == modelled
        assert "saving modelled storage by storage" in advice.evidence


# ------------------------------------------------------------------------------------------------ mixed-precision


def test_mixed_precision_advises_the_replayed_memory_saving() -> None:
    summary = healthy_summary()
    advice = mixed_precision(
        summary, healthy_setup(precision="32-true"), simulated(replayed(PrecisionChange("bf16-mixed"), 7 * GIB))
    )
    assert advice is not None
    assert (
        advice.title
        == 'Train with precision="bf16-mixed" to lower the peak by about 1.00 GiB and run matmuls on tensor cores'
    )
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        GIB,
        "simulated",
        7 * GIB,
    )
    assert (
        "Memory: replayed on this run's step in bf16-mixed, the peak is 7.00 GiB instead of 8.00 GiB (1.00 GiB lower)."
        in (advice.detail)
    )


@pytest.mark.parametrize(
    ("replayed_peak", "expected"),
    [(8 * GIB - 400 * MIB, "400.0 MiB lower"), (9 * GIB, "1.00 GiB higher")],
    ids=["under-the-threshold", "higher"],
)
def test_mixed_precision_below_the_threshold_advises_speed_only(replayed_peak: int, expected: str) -> None:
    # 400 MiB is 4.9% of the 8 GiB peak: under the 5% a memory saving needs. Tensor cores still speak for it.
    simulation = simulated(replayed(PrecisionChange("bf16-mixed"), replayed_peak))
    advice = mixed_precision(healthy_summary(), healthy_setup(precision="32-true"), simulation)
    assert advice is not None
    assert advice.title == 'Train with precision="bf16-mixed" to run matmuls on tensor cores'
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        None,
        None,
        replayed_peak,
    )
    assert "Memory is not the reason to change: replayed on this run's step in bf16-mixed" in advice.detail
    assert f"({expected})" in advice.detail


def test_mixed_precision_near_misses_with_a_replay() -> None:
    setup = healthy_setup(precision="32-true")
    broke = simulated(discarded(PrecisionChange("bf16-mixed"), "RuntimeError: expected scalar type BFloat16"))
    assert mixed_precision(healthy_summary(), setup, broke) is None
    # The peak would rise to 15 of the 16 GiB: not worth the speed.
    assert (
        mixed_precision(healthy_summary(), setup, simulated(replayed(PrecisionChange("bf16-mixed"), 15 * GIB))) is None
    )
    # A replay of the other precision is not this advice's: no memory figure.
    other = mixed_precision(healthy_summary(), setup, simulated(replayed(PrecisionChange("16-mixed"), 6 * GIB)))
    assert other is not None and other.estimated_saving_bytes is None and other.predicted_peak_bytes is None


def test_mixed_precision_without_tensor_cores_advises_only_a_replayed_memory_saving() -> None:
    pascal = healthy_summary(device=replace(GPU, compute_capability=(6, 1)))
    setup = healthy_setup(precision="32-true")
    assert mixed_precision(pascal, setup) is None
    advice = mixed_precision(pascal, setup, simulated(replayed(PrecisionChange("16-mixed"), 7 * GIB)))
    assert advice is not None
    assert advice.title == 'Train with precision="16-mixed" to lower the peak by about 1.00 GiB'
    assert "tensor cores" not in text_of(advice)
    assert mixed_precision(pascal, setup, simulated(replayed(PrecisionChange("16-mixed"), 8 * GIB - MIB))) is None


@pytest.mark.parametrize("peak_bytes", [None, 5 * GIB, 7 * GIB, 8 * GIB - MIB, 9 * GIB])
@pytest.mark.parametrize("capability", [(8, 0), (7, 5), (6, 1)])
def test_mixed_precision_never_promises_half_the_activations(
    peak_bytes: int | None, capability: tuple[int, int]
) -> None:
    summary = healthy_summary(device=replace(GPU, compute_capability=capability))
    precision = "bf16-mixed" if capability >= (8, 0) else "16-mixed"
    simulation = simulated(replayed(PrecisionChange(precision), peak_bytes)) if peak_bytes is not None else None
    advice = mixed_precision(summary, healthy_setup(precision="32-true"), simulation)
    if advice is None:
        return
    assert "half" not in text_of(advice).lower()
    assert advice.estimated_saving_bytes != HEALTHY_BREAKDOWN.activations // 2
    if advice.estimated_saving_bytes is not None:
        assert peak_bytes is not None and advice.estimated_saving_bytes == 8 * GIB - peak_bytes


# ------------------------------------------------------------------------------------------------ inplace, gradients


def inplace_case() -> tuple[RunSummary, TrainingSetup, InplaceChange]:
    summary = healthy_summary(modules=(leaky_relu(),))
    setup = healthy_setup(inplace_keeps_result=("body.1",))
    assert inplace_candidates(summary, setup) == ("body.1",)
    return summary, setup, InplaceChange(("body.1",))


def test_inplace_activations_uses_the_replayed_saving() -> None:
    summary, setup, change = inplace_case()
    advice = inplace_activations(summary, setup, simulated(replayed(change, 8 * GIB - 300 * MIB)))
    assert advice is not None
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        300 * MIB,
        "simulated",
        8 * GIB - 300 * MIB,
    )
    modelled = inplace_activations(summary, setup)
    assert modelled is not None and (modelled.estimated_saving_bytes, modelled.saving_basis) == (200 * MIB, "modelled")


def test_inplace_activations_near_misses_with_a_replay() -> None:
    summary, setup, change = inplace_case()
    # 100 MiB is 1.2% of the peak: under the 2% inplace needs, though the merged inputs would pass.
    assert inplace_activations(summary, setup, simulated(replayed(change, 8 * GIB - 100 * MIB))) is None
    assert inplace_activations(summary, setup, simulated(discarded(change))) is None


def stale_case() -> tuple[RunSummary, Simulation]:
    # Measured: forward 8 GiB with 1 GiB of gradients, backward 7.5 GiB; modelled saving 0.5 GiB.
    summary = forward_peak_summary(7 * GIB + 512 * MIB)
    return summary, simulated(baseline=step(8 * GIB, 7 * GIB + 512 * MIB))


def test_stale_gradients_uses_the_replayed_saving() -> None:
    summary, simulation = stale_case()
    change = FreeGradientsChange()
    freed = replace(simulation, variants=(VariantResult(change, step(7 * GIB, 7 * GIB + 256 * MIB)),))
    advice = stale_gradients(summary, healthy_setup(), freed)
    assert advice is not None
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        768 * MIB,
        "simulated",
        7 * GIB + 256 * MIB,
    )
    assert "takes the allocator peak from 8.00 GiB in forward to 7.25 GiB in backward" in advice.evidence
    modelled = stale_gradients(summary, healthy_setup(), simulation)  # the change was not replayed
    assert modelled is not None and (modelled.estimated_saving_bytes, modelled.saving_basis) == (512 * MIB, "modelled")


def test_stale_gradients_near_misses_with_a_replay() -> None:
    summary, simulation = stale_case()
    change = FreeGradientsChange()
    small = replace(simulation, variants=(VariantResult(change, step(7 * GIB, 8 * GIB - 100 * MIB)),))
    assert stale_gradients(summary, healthy_setup(), small) is None  # 100 MiB: 1.2% of the peak
    assert stale_gradients(summary, healthy_setup(), replace(simulation, variants=(discarded(change),))) is None


# ------------------------------------------------------------------------------------------------ chunked-loss


def loss_heavy(loss_bytes: int, activations: int = 4 * GIB, backward_gradients: int = 0) -> Simulation:
    """Forward 8 GiB (``activations`` of it saved), backward 7 GiB, the optimizer 4 GiB."""
    forward = replace(HEALTHY_BREAKDOWN, activations=activations)
    backward = replace(HEALTHY_BREAKDOWN, gradients=backward_gradients, activations=activations)
    breakdowns = {Phase.FORWARD: forward, Phase.BACKWARD: backward}
    return simulated(baseline=step(8 * GIB, 7 * GIB, breakdowns=breakdowns, loss_bytes=loss_bytes))


def test_chunked_loss_fires_on_the_loss_share_with_a_modelled_saving() -> None:
    # The loss saved 2 GiB, half of the forward pass's activations. In 8 chunks: forward 8 - 2 = 6 GiB; backward
    # starts holding one chunk's instead of all: 7 - 2 + 0.25 GiB; the optimizer 4 GiB. Peak 6 GiB: 2 GiB saved.
    advice = chunked_loss(healthy_summary(), healthy_setup(), loss_heavy(2 * GIB))
    assert advice is not None
    assert advice.id == "chunked-loss"
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        2 * GIB,
        "modelled",
        None,
    )
    assert advice.title == "Compute the loss in chunks to lower the peak by about 2.00 GiB"
    assert (
        "the loss's own ops saved 2.00 GiB, 50.0% of the forward pass's activations and 25.0% of the replayed"
        " forward peak (8.00 GiB)" in advice.evidence
    )
    assert "checkpoint(chunk_loss, h, t, use_reentrant=False)" in advice.detail
    assert "LigerFusedLinearCrossEntropyLoss" in advice.detail
    # A backward peak with gradients already made is past the loss: it stays, and bounds the saving.
    later = chunked_loss(healthy_summary(), healthy_setup(), loss_heavy(2 * GIB, backward_gradients=GIB))
    assert later is not None and later.estimated_saving_bytes == GIB


def test_chunked_loss_near_misses() -> None:
    assert chunked_loss(healthy_summary(), healthy_setup(), loss_heavy(GIB - 1)) is None  # under 25% of activations
    small = loss_heavy(300 * MIB, activations=GIB)  # 29% of the activations but 3.7% of the peak
    assert chunked_loss(healthy_summary(), healthy_setup(), small) is None
    assert chunked_loss(healthy_summary(), healthy_setup(), None) is None
    untrusted = replace(loss_heavy(2 * GIB), skipped="the replay does not reproduce sampled step 5")
    assert chunked_loss(healthy_summary(), healthy_setup(), untrusted) is None


# ------------------------------------------------------------------------------------------------ batch size, fit


def test_batch_size_headroom_uses_the_replayed_largest_batch() -> None:
    advice = batch_size_headroom(headroom_summary(), healthy_setup(), simulated(device_max_batch_size=300))
    assert advice is not None
    assert advice.title == "A batch of up to 300 fits, replayed (now 32): the GPU is underused"
    assert "largest batch found by replaying this step at each batch size tried" in advice.evidence
    assert advice.saving_basis is None
    # The replay finds 50 fit, under twice the batch, where the linear model promised hundreds.
    assert batch_size_headroom(headroom_summary(), healthy_setup()) is not None
    assert batch_size_headroom(headroom_summary(), healthy_setup(), simulated(device_max_batch_size=50)) is None
    modelled = batch_size_headroom(headroom_summary(), healthy_setup(), simulated())
    assert modelled is not None and "should fit" in modelled.title and "modelled linearly" in modelled.evidence


def test_fit_table_says_its_basis() -> None:
    rows = (FitRow("T4 (16 GiB)", 16 * GIB, 123), FitRow("A100 40GB", 40 * GIB, 321))
    replayed_rows = fit_table(headroom_summary(), simulated(fit=rows))
    assert [(row.max_batch_size, row.basis) for row in replayed_rows] == [(123, "simulated"), (321, "simulated")]
    modelled = fit_table(headroom_summary(), replace(simulated(fit=rows), skipped="not trusted"))
    assert modelled and all(row.basis == "modelled" for row in modelled)
    assert fit_table(headroom_summary(device=CPU), simulated(fit=rows)) == replayed_rows


# ------------------------------------------------------------------------------------------------ near capacity, all


def test_near_capacity_lists_replayed_remedies_with_their_basis() -> None:
    full = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=8 * GIB, other=3 * GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB, full))
    simulation = simulated(
        replayed(PrecisionChange("bf16-mixed"), 12 * GIB),
        replayed(BatchSizeChange(16), 9 * GIB),
        baseline=step(14 * GIB, 15 * GIB),
    )
    advice = near_capacity(summary, healthy_setup(precision="32-true"), simulation)
    assert advice is not None
    assert advice.detail == (
        "Remedies this run's measurements support, largest saving first: halve the batch to 16 (with"
        " accumulate_grad_batches=2): about 6.00 GiB (simulated); mixed-precision: about 3.00 GiB (simulated)."
    )
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        6 * GIB,
        "simulated",
        9 * GIB,
    )


def test_advise_passes_the_simulation_to_every_rule() -> None:
    assert advise(healthy_summary(), healthy_setup(), simulated(replayed(FreeGradientsChange(), 7 * GIB))) == ()
    summary = checkpoint_summary()
    plan = checkpoint_candidates(summary.modules)[0]
    (advice,) = advise(summary, healthy_setup(), simulated(replayed(CheckpointChange(plan), 6 * GIB)))
    assert (advice.id, advice.saving_basis) == ("activation-checkpointing", "simulated")


def optimizer_heavy() -> RunSummary:
    return healthy_summary(
        peak=peak(
            Phase.BACKWARD, 8 * GIB, replace(HEALTHY_BREAKDOWN, optimizer_state=4 * GIB, activations=GIB, other=GIB)
        )
    )


def test_without_a_simulation_every_saving_says_modelled_and_advice_without_one_says_nothing() -> None:
    weight = 4096 * 512 * 49 * 4
    vgg = healthy_summary(modules=(replace(blocks(1, 0, 0)[0], name="classifier.0", input_feature_map=(512, 49)),))
    cases = [
        (activation_checkpointing, checkpoint_summary(), healthy_setup()),
        (inplace_activations, *inplace_case()[:2]),
        (stale_gradients, forward_peak_summary(7 * GIB), healthy_setup()),
        (optimizer_state, optimizer_heavy(), healthy_setup(optimizers=("AdamW",))),
        (
            large_linear,
            vgg,
            healthy_setup(linear_layers=(LinearLayer("classifier.0", 512 * 49, 4096, weight, weight),)),
        ),
        (
            allocator_fragmentation,
            healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, reserved=11 * GIB)),
            healthy_setup(),
        ),
    ]
    for rule, summary, setup in cases:
        advice = rule(summary, setup)
        assert advice is not None and advice.estimated_saving_bytes is not None, rule.__name__
        assert (advice.saving_basis, advice.predicted_peak_bytes) == ("modelled", None), rule.__name__
    waiting = healthy_summary(data_wait_fraction=0.3, recent_data_wait_fraction=0.3, timed_steps=50)
    speed = [
        dataloader_workers(waiting, healthy_setup(num_workers=0)),
        pin_memory(waiting, healthy_setup(pin_memory=False)),
        batch_size_headroom(headroom_summary(), healthy_setup()),
    ]
    assert all(advice is not None and advice.saving_basis is None for advice in speed)


# ------------------------------------------------------------------------------------------------ report and codec


def full_simulation() -> Simulation:
    summary = checkpoint_summary()
    plans = checkpoint_candidates(summary.modules)
    # Every counted part of every phase as measured; the replay's forward activations 3 MiB over.
    parts = [
        PartMatch(phase, part, value, value + (3 * MIB if (phase, part) == (Phase.FORWARD, "activations") else 0))
        for phase in Phase
        for part, value in HEALTHY_BREAKDOWN.to_dict().items()
        if part != "other" and value is not None
    ]
    match = BaselineMatch(step=5, parts=tuple(parts), tolerance=0.01)
    return replace(
        simulated(
            replayed(CheckpointChange(plans[0]), 6 * GIB),
            discarded(CheckpointChange(plans[1])),
            replayed(PrecisionChange("bf16-mixed"), 7 * GIB + 512 * MIB),
            replayed(InplaceChange(("body.1", "body.3")), 8 * GIB),
            replayed(FreeGradientsChange(), 7 * GIB),
            replayed(BatchSizeChange(16), 5 * GIB),
            device_max_batch_size=48,
            fit=(FitRow("T4 (16 GiB)", 16 * GIB, 60),),
        ),
        match=match,
        baseline=replace(BASELINE, loss_activation_bytes=MIB, notes=("aten._cudnn_rnn keeps a workspace",)),
    )


def report_with(simulation: Simulation | None) -> Report:
    summary = checkpoint_summary()
    return build_report(
        summary, healthy_setup(precision="32-true"), top_modules=3, ranks=(), not_measured=(), simulation=simulation
    )


def test_report_json_carries_the_simulation_and_each_advice_basis() -> None:
    report = report_with(full_simulation())
    data = report.to_dict()
    advice = {entry["id"]: entry for entry in data["advice"]}
    assert advice["activation-checkpointing"]["saving_basis"] == "simulated"
    assert advice["activation-checkpointing"]["predicted_peak_bytes"] == 6 * GIB
    assert advice["mixed-precision"]["saving_basis"] == "simulated"
    assert data["fit"] == [
        {
            "device": "T4 (16 GiB)",
            "capacity_bytes": 16 * GIB,
            "max_batch_size": 60,
            "basis": "simulated",
            "at_least": False,
        }
    ]
    section = data["simulation"]
    assert {key: section[key] for key in ("device_type", "seconds", "skipped", "step", "peak_bytes", "peak_phase")} == {
        "device_type": "cuda",
        "seconds": 1.5,
        "skipped": None,
        "step": 5,
        "peak_bytes": 8 * GIB,
        "peak_phase": "backward",
    }
    assert section["baseline"]["matches"] is True and section["baseline"]["parts"][3] == {
        "phase": "forward",
        "part": "activations",
        "measured_bytes": 3 * GIB,
        "replayed_bytes": 3 * GIB + 3 * MIB,
    }
    assert len(section["baseline"]["parts"]) == 12
    assert section["phases"]["backward"] == {"peak_bytes": 8 * GIB, "breakdown": HEALTHY_BREAKDOWN.to_dict()}
    kinds = [
        (variant["kind"], variant["predicted_peak_bytes"], variant["discarded"]) for variant in section["variants"]
    ]
    assert kinds == [
        ("checkpoint", 6 * GIB, None),
        ("checkpoint", None, BROKEN),
        ("precision", 7 * GIB + 512 * MIB, None),
        ("inplace", 8 * GIB, None),
        ("free-gradients", 7 * GIB, None),
        ("batch-size", 5 * GIB, None),
    ]
    assert section["variants"][3]["parameters"] == {"modules": ["body.1", "body.3"]}
    assert section["variants"][5]["change"] == "batch size 16" and section["device_max_batch_size"] == 48
    json.dumps(data, allow_nan=False)


def test_report_round_trips_with_its_simulation() -> None:
    report = report_with(full_simulation())
    rebuilt = report_from_dict(json.loads(json.dumps(report.to_dict())))
    assert rebuilt.to_dict() == report.to_dict()
    assert rebuilt.simulation is not None and report.simulation is not None
    assert [variant.change for variant in rebuilt.simulation.variants] == [
        variant.change for variant in report.simulation.variants
    ]
    assert rebuilt.simulation.match == report.simulation.match
    assert rebuilt.advice == report.advice and rebuilt.fit == report.fit
    skipped = Simulation(
        "cuda", None, None, "manual optimization: the replay follows automatic optimization only", (), 0.0
    )
    for simulation in (skipped, None):
        plain = report_with(simulation)
        assert report_from_dict(plain.to_dict()).to_dict() == plain.to_dict()


def test_a_report_written_before_the_replay_still_reads() -> None:
    data = report_with(full_simulation()).to_dict()
    del data["simulation"]
    for entry in data["advice"]:
        del entry["saving_basis"], entry["predicted_peak_bytes"]
    for row in data["fit"]:
        del row["basis"]
    report = report_from_dict(data)
    assert report.simulation is None
    assert all(advice.saving_basis is None and advice.predicted_peak_bytes is None for advice in report.advice)
    assert [row.basis for row in report.fit] == ["modelled"]


def mistyped(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    data = report_with(full_simulation()).to_dict()
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("advice", 0, "saving_basis"), "guessed", "advice[0].saving_basis must be one of ['simulated', 'modelled']"),
        (("advice", 0, "predicted_peak_bytes"), "1", "advice[0].predicted_peak_bytes must be an integer, got str"),
        (("fit", 0, "basis"), None, "fit[0].basis must be a string, got null"),
        (("fit", 0, "basis"), "measured", "fit[0].basis must be one of"),
        (("simulation",), [], "report.simulation must be an object, got list"),
        (("simulation", "seconds"), "1", "report.simulation.seconds must be a number, got str"),
        (("simulation", "variants", 0, "kind"), "teleport", "report.simulation.variants[0].kind must be one of"),
        (("simulation", "variants", 0, "parameters", "units", 0, 0), 1, "units[0][0] must be a string, got int"),
        (
            ("simulation", "variants", 2, "phases", "sideways"),
            {},
            "must be one of ['forward', 'backward', 'optimizer']",
        ),
        (
            ("simulation", "variants", 0, "phases"),
            None,
            "variants[0]: a change neither replayed (phases) nor discarded",
        ),
        (("simulation", "baseline", "parts", 0, "part"), "weights", "parts[0].part must be one of"),
        (
            ("simulation", "baseline", "matches"),
            "yes",
            "report.simulation.baseline.matches must be true, false or null",
        ),
        (("simulation", "phases", "forward", "peak_bytes"), -1, "peak_bytes must be >= 0, got -1"),
    ],
    ids=lambda value: str(value)[:24],
)
def test_mistyped_simulation_fields_are_refused(path: tuple[str | int, ...], value: Any, message: str) -> None:
    with pytest.raises(FormatError) as error:
        report_from_dict(mistyped(path, value))
    assert message in str(error.value)


def test_markdown_html_and_console_show_predicted_against_measured() -> None:
    report = report_with(full_simulation())
    text = markdown(report)
    assert (
        "**Expected saving:** about 2.00 GiB of peak memory (simulated: replayed peak 6.00 GiB after the change)"
        in text
    )
    assert "## Simulation" in text
    # Measured and replayed counted parts, the run's allocator peaks and the replayed ones, per phase.
    assert "| forward | 6.00 GiB | 6.00 GiB | activations +0.10% | 7.00 GiB | 7.00 GiB |" in text
    assert "| backward | 6.00 GiB | 6.00 GiB | none | 8.00 GiB | 8.00 GiB |" in text
    assert "| batch size 16 | 5.00 GiB | -3.00 GiB | replayed, peak in backward |" in text
    assert (
        "| checkpoint 4 units of encoder.layers (encoder.layers.0 to encoder.layers.3) | n/a | n/a | discarded:" in text
    )
    assert "discarded: RuntimeError: one of the" in text
    assert "| T4 (16 GiB) | 16.00 GiB | 60 | simulated |" in text
    assert "- aten.\\_cudnn_rnn keeps a workspace" in text
    page = render_html(report)
    assert "<h2>Simulation</h2>" in page and '<table id="simulation-variants">' in page
    assert '<td class="n">60</td><td>simulated</td>' in page  # the fit table's basis
    assert "about 2.00 GiB of peak memory (simulated: replayed peak 6.00 GiB after the change)" in page
    console = summary_text(report)
    assert "advice [activation-checkpointing]: Checkpoint 3 units" in console
    assert console.count("(simulated)") == 2  # checkpointing and mixed precision; the others have no memory figure
    # A discarded change's reason is the user's exception text: escaped in both, never markup.
    hostile = replace(
        full_simulation(),
        variants=(discarded(FreeGradientsChange(), "ValueError: <img src=x onerror=alert(1)> | `x`"),),
    )
    assert "discarded: ValueError: \\<img src=x onerror=alert(1)\\> \\| \\`x\\` |" in markdown(report_with(hostile))
    assert "discarded: ValueError: &lt;img src=x onerror=alert(1)&gt; | `x`</td>" in render_html(report_with(hostile))
    modelled = markdown(report_with(None))
    assert "about 2.01 GiB of peak memory (modelled)" in modelled and "## Simulation" not in modelled
    skipped = Simulation(
        "cpu", None, None, "manual optimization: the replay follows automatic optimization only", (), 0.0
    )
    assert (
        "The step was not replayed: manual optimization: the replay follows automatic optimization only. Every saving"
        " in this report is modelled." in markdown(report_with(skipped))
    )


# ------------------------------------------------------------------------------------- applied on the CPU, for real


@dataclass(frozen=True)
class Run:
    """A monitored CPU run, the replay of its sampled step with every change the rules could advise, the advice."""

    report: Report
    setup: TrainingSetup
    simulation: Simulation
    advice: tuple[Advice, ...]

    @property
    def peak_bytes(self) -> int:
        assert self.report.peak is not None
        return self.report.peak.peak_bytes

    def find(self, advice_id: str) -> Advice | None:
        return next((advice for advice in self.advice if advice.id == advice_id), None)


def candidate_changes(summary: RunSummary, setup: TrainingSetup) -> list[StepChange]:
    """What the session replays: bf16-mixed (on the CPU), the checkpointing candidates, inplace, freed gradients."""
    changes: list[StepChange] = [PrecisionChange("bf16-mixed")] if setup.precision in FULL_PRECISIONS else []
    changes += [CheckpointChange(plan) for plan in checkpoint_candidates(summary.modules)]
    if names := inplace_candidates(summary, setup):
        changes.append(InplaceChange(names))
    return [*changes, FreeGradientsChange()]


def monitored(
    root: Path,
    module: pl.LightningModule,
    data: Dataset[Any],
    batch_size: int,
    on: DeviceInfo | None = None,
    **options: Any,
) -> Run:
    """Three steps with step 1 counted; its replay; the advice as if on device ``on`` (default: the CPU run's)."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    batches = loader(data, batch_size)
    fit = trainer(root, [monitor], max_steps=3, **options)
    fit.fit(module, batches)
    report = monitor.report
    assert report is not None
    setup = trainer_setup(fit, module)
    attribution = monitor.session._tracker.latest_attribution
    changes = candidate_changes(report.summary, setup)
    assert attribution is not None
    forward = attribution.phases[Phase.FORWARD]
    simulation = simulate(
        module,
        fit.optimizers,
        next(iter(batches)),
        attribution,
        changes,
        precision=setup.precision,
        gradients_at_forward=forward.gradients > 0,  # as the session replays it: the state the forward pass saw
    )
    assert simulation.skipped is None, simulation.skipped
    summary = report.summary if on is None else replace(report.summary, device=on)
    return Run(report, setup, simulation, advise(summary, setup, simulation))


def snippet(advice: Advice) -> str:
    (code,) = re.findall(r"```python\n(.*?)\n```", advice.detail, re.DOTALL)
    return code


def assert_realised(before: Run, after: Run, advice: Advice) -> None:
    assert advice.saving_basis in ("simulated", "modelled") and advice.estimated_saving_bytes is not None
    assert before.peak_bytes - after.peak_bytes == pytest.approx(advice.estimated_saving_bytes, rel=0.1)
    if advice.saving_basis == "simulated":
        assert advice.predicted_peak_bytes == pytest.approx(after.peak_bytes, rel=0.1)
    assert after.find(advice.id) is None


def test_checkpointing_applied_on_a_transformer_saves_what_the_replay_said(tmp_path: Path) -> None:
    before = monitored(tmp_path / "before", LanguageModel(TinyGPT()), tokens(32), 16)
    advice = before.find("activation-checkpointing")
    assert advice is not None and advice.saving_basis == "simulated"
    (plan,) = [
        plan
        for plan in checkpoint_candidates(before.report.summary.modules)
        if checkpoint_snippet(plan)[1] in advice.detail
    ]
    module = LanguageModel(TinyGPT())
    apply_plan(module, plan)
    assert_realised(before, monitored(tmp_path / "after", module, tokens(32), 16), advice)


A100 = DeviceInfo("cuda", "NVIDIA A100", 0, 80 * GIB, (8, 0))
"""The CPU runs judged as if on an A100: mixed precision is advised on CUDA only; the replay stays the CPU's."""


def test_mixed_precision_applied_on_a_resnet_saves_what_the_replay_said(tmp_path: Path) -> None:
    def build() -> Classifier:
        return Classifier(resnet(), OPTIMIZERS["sgd_momentum"])

    before = monitored(tmp_path / "before", build(), images(64), 16, on=A100)
    advice = before.find("mixed-precision")
    assert advice is not None and advice.saving_basis == "simulated"
    assert 'Trainer(precision="bf16-mixed")' in advice.detail
    after = monitored(tmp_path / "after", build(), images(64), 16, on=A100, precision="bf16-mixed")
    assert_realised(before, after, advice)


def test_inplace_activations_applied_saves_what_the_replay_said(tmp_path: Path) -> None:
    before = monitored(
        tmp_path / "before", Classifier(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"]), features(1024, 256), 512
    )
    advice = before.find("inplace-activations")
    assert advice is not None and advice.saving_basis == "simulated"
    assert snippet(advice) == "nn.LeakyReLU(inplace=True)"
    inplace = Classifier(activation_mlp(nn.LeakyReLU, inplace=True), OPTIMIZERS["adam"])
    assert_realised(before, monitored(tmp_path / "after", inplace, features(1024, 256), 512), advice)


def test_stale_gradients_applied_saves_what_the_replay_said(tmp_path: Path) -> None:
    before = monitored(
        tmp_path / "before", Classifier(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"]), features(1024, 256), 512
    )
    advice = before.find("stale-gradients")
    assert advice is not None and advice.saving_basis == "simulated"
    namespace: dict[str, Any] = {}
    exec(snippet(advice), namespace)  # the advice's own code, as the user pastes it into the LightningModule

    class FreesGradients(Classifier):
        on_train_batch_start = namespace["on_train_batch_start"]

    module = FreesGradients(activation_mlp(nn.LeakyReLU), OPTIMIZERS["adam"])
    after = monitored(tmp_path / "after", module, features(1024, 256), 512)
    assert after.simulation.skipped is None  # the replay starts from the freed gradients the run's forward saw
    assert_realised(before, after, advice)


class ChunkedLanguageModel(LanguageModel):
    """Next-token prediction with the loss computed by the chunked-loss advice's own function."""

    def __init__(self, network: TinyGPT, chunked_cross_entropy: Any) -> None:
        super().__init__(network, OPTIMIZERS["adam"])
        self.chunked_cross_entropy = chunked_cross_entropy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        network = self.network
        assert isinstance(network, TinyGPT)
        x = network.wte(ids) + network.wpe(torch.arange(ids.shape[1]))
        for block in network.h:
            x = block(x)
        hidden = network.ln_f(x).flatten(0, 1)
        return self.chunked_cross_entropy(hidden, network.lm_head, targets.flatten())  # type: ignore[no-any-return]


def test_chunked_loss_applied_saves_what_it_modelled(tmp_path: Path) -> None:
    # A 4096-token vocabulary: the log-probabilities of 8 x 32 positions are 4 MiB, two thirds of the activations.
    before = monitored(
        tmp_path / "before", LanguageModel(TinyGPT(vocab=4096, layers=2), OPTIMIZERS["adam"]), tokens(64, vocab=4096), 8
    )
    advice = before.find("chunked-loss")
    assert advice is not None and advice.saving_basis == "modelled"
    assert (
        before.simulation.baseline is not None and before.simulation.baseline.loss_activation_bytes == 8 * 32 * 4096 * 4
    )
    namespace: dict[str, Any] = {}
    exec(snippet(advice), namespace)
    module = ChunkedLanguageModel(TinyGPT(vocab=4096, layers=2), namespace["chunked_cross_entropy"])
    assert_realised(before, monitored(tmp_path / "after", module, tokens(64, vocab=4096), 8), advice)
