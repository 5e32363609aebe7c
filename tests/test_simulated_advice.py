"""Advice read from the step replay: each rule on hand-built simulations.

Hand-built replays are CUDA replays (their peaks are the allocator's ``peak_bytes``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
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
from simulations import GIB, MIB, checkpoint_summary, discarded, replayed, simulated, step

from lightning_vram.advice.capacity import fit_table
from lightning_vram.advice.checkpoint_code import checkpoint_snippet
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.rules.activation_checkpointing import activation_checkpointing
from lightning_vram.advice.rules.allocator_fragmentation import allocator_fragmentation
from lightning_vram.advice.rules.batch_size_headroom import batch_size_headroom
from lightning_vram.advice.rules.chunked_loss import chunked_loss
from lightning_vram.advice.rules.dataloader_workers import dataloader_workers
from lightning_vram.advice.rules.inplace_activations import inplace_activations, inplace_candidates
from lightning_vram.advice.rules.large_linear import large_linear
from lightning_vram.advice.rules.mixed_precision import mixed_precision
from lightning_vram.advice.rules.near_capacity import near_capacity
from lightning_vram.advice.rules.optimizer_state import optimizer_state
from lightning_vram.advice.rules.pin_memory import pin_memory
from lightning_vram.advice.rules.registry import advise
from lightning_vram.advice.rules.stale_gradients import stale_gradients
from lightning_vram.records import (
    Advice,
    BatchSizeChange,
    Breakdown,
    CheckpointChange,
    CheckpointPlan,
    FitRow,
    FreeGradientsChange,
    InplaceChange,
    LinearLayer,
    Phase,
    PrecisionChange,
    RunSummary,
    Simulation,
    TrainingSetup,
    VariantResult,
)

# Advice from replayed changes (simulated savings, the fit table).
pytestmark = pytest.mark.replay

# ------------------------------------------------------------------------------------------------ hand-built replays


def test_replayed_peaks_are_read_as_the_report_measures_them() -> None:
    # Live peaks everywhere: on CUDA the allocator's (every live tensor in blocks), on the CPU every live tensor's
    # bytes, as the CPU report's peaks are; never the counted parts alone.
    cuda, cpu = step(9 * GIB, 8 * GIB), step(9 * GIB, 8 * GIB, device="cpu")
    assert (cuda.reported_peak.phase, cuda.reported_bytes(cuda.reported_peak)) == (Phase.FORWARD, 9 * GIB)
    assert cpu.reported_bytes(cpu.phases[Phase.BACKWARD]) == 8 * GIB > HEALTHY_BREAKDOWN.counted_bytes
    assert (cpu.reported_peak.phase, cpu.reported_bytes(cpu.reported_peak)) == (Phase.FORWARD, 9 * GIB)


def text_of(advice: Advice) -> str:
    return f"{advice.title}\n{advice.detail}\n{advice.evidence}"


# ---------------------------------------------------------------------------------------- activation-checkpointing


def test_checkpointing_advises_the_replayed_saving() -> None:
    summary = checkpoint_summary()
    plans = checkpoint_candidates(summary.modules)
    assert len(plans) == 4 and plans[0].saving_bytes == (3000 - 942) * MIB
    assert plans[3].units == plans[0].units[:-1]  # the best without its last unit, for its replay to judge
    advice = activation_checkpointing(
        summary, healthy_setup(), simulated(replayed(CheckpointChange(plans[0]), 6 * GIB))
    )
    assert advice is not None
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        2 * GIB,
        "simulated",
        6 * GIB,
    )
    assert advice.title == "Checkpoint `encoder.layers.0` to `encoder.layers.2` (3 units) to free about 2.00 GiB"
    assert f"{CheckpointChange(plans[0]).label} lowers the allocator peak by 2.00 GiB, from the measured" in (
        advice.evidence
    )
    assert "(replayed on this run's step from 8.00 GiB in backward to 6.00 GiB in backward)" in advice.evidence
    assert checkpoint_snippet(plans[0])[1] in advice.detail


KEPT = ": matrix products and attention kept"


@pytest.mark.parametrize(
    ("units", "selective", "what", "label"),
    [
        ((("h.0",), ("h.1",), ("h.2",)), (), "`h.0` to `h.2` (3 units)", "checkpoint h.0 to h.2 (3 units)"),
        (
            (("h.0",), ("h.1",), ("h.2",)),
            ("h.1", "h.2"),
            f"`h.0` to `h.2` (3 units, 2 selectively{KEPT})",
            "checkpoint h.0 to h.2 (3 units, 2 selectively)",
        ),
        ((("h.1",), ("h.3",)), (), "2 of the units from `h.1` to `h.3`", "checkpoint 2 of the units from h.1 to h.3"),
        ((("h.0",),), ("h.0",), f"`h.0` (selectively{KEPT})", "checkpoint h.0 (selectively)"),
        ((("h.3", "h.4"),), (), "`h.3`+`h.4`", "checkpoint h.3+h.4"),
    ],
)
def test_a_plan_names_its_units_first_to_last_and_counts_them_once(
    units: tuple[tuple[str, ...], ...], selective: tuple[str, ...], what: str, label: str
) -> None:
    """The trial's title: "Checkpoint 3 units of `encoder.layers`, `encoder.layers.0` to `encoder.layers.2`"."""
    plan = CheckpointPlan("h", units, None, 0, "", selective=selective)
    assert checkpoint_snippet(plan)[0] == what
    assert CheckpointChange(plan).label == label


def test_checkpointing_under_the_threshold_when_replayed_is_silent() -> None:
    summary = checkpoint_summary()
    plan = checkpoint_candidates(summary.modules)[0]
    assert activation_checkpointing(summary, healthy_setup()) is not None  # modelled: 2 GiB of 8
    # Replayed, it frees 0.5 GiB of 8: under a tenth of the peak.
    small = simulated(replayed(CheckpointChange(plan), 7 * GIB + 512 * MIB))
    assert activation_checkpointing(summary, healthy_setup(), small) is None


def test_a_plan_whose_replay_raised_is_never_advised() -> None:
    summary = checkpoint_summary()
    first, second, third, fourth = checkpoint_candidates(summary.modules)
    runner_up = simulated(discarded(CheckpointChange(first)), replayed(CheckpointChange(second), 6 * GIB + 512 * MIB))
    advice = activation_checkpointing(summary, healthy_setup(), runner_up)
    assert advice is not None and advice.estimated_saving_bytes == 3 * GIB // 2
    assert checkpoint_snippet(second)[1] in advice.detail and checkpoint_snippet(first)[1] not in advice.detail
    assert f"not advised, its replay raised: {CheckpointChange(first).label} (RuntimeError: one of" in advice.evidence
    every = simulated(*(discarded(CheckpointChange(plan)) for plan in (first, second, third, fourth)))
    assert activation_checkpointing(summary, healthy_setup(), every) is None
    # Some discarded, the rest not replayed: none is known to work, none is advised.
    assert activation_checkpointing(summary, healthy_setup(), simulated(discarded(CheckpointChange(first)))) is None


def test_checkpointing_picks_the_plan_whose_replay_saves_most() -> None:
    summary = checkpoint_summary()
    first, second, *_ = checkpoint_candidates(summary.modules)
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
    out_of_time = discarded(CheckpointChange(plan), "not replayed: the replay budget ran out of 30.0 s first")
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
    # Quoted against the report's peak (8 GiB measured), the replay's own figures beside it.
    assert (
        "lowers the allocator peak by 768.0 MiB, from the measured 8.00 GiB in forward to about 7.25 GiB in backward"
        " (replayed on this run's step from 8.00 GiB in forward to 7.25 GiB in backward)" in advice.evidence
    )
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
    # The loss saved 2 GiB, half of the forward pass's activations; 2 GiB more are alive beyond the counted parts
    # ("other": the logits in forward, the gradients in backward). In 8 chunks, one eighth of each is held at a
    # time: forward 8 - 4 + 0.5 = 4.5 GiB; backward starts with the log-probabilities and (up to "other") the
    # gradients: 7 - 4 + 0.5 = 3.5 GiB; the optimizer 4 GiB. Peak 4.5 GiB: 3.5 GiB saved.
    advice = chunked_loss(healthy_summary(), healthy_setup(), loss_heavy(2 * GIB))
    assert advice is not None
    assert advice.id == "chunked-loss"
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        3 * GIB + 512 * MIB,
        "modelled",
        None,
    )
    assert advice.title == (
        "Compute the loss in chunks to lower the peak by about 3.50 GiB (the loss then agrees to float32 rounding,"
        " not bit for bit)"
    )
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
    # Searched in the simulated caching allocator: no margin, and the evidence names the settings it assumed.
    row = FitRow("T4 (16 GiB)", 16 * GIB, 300, allocator="expandable_segments:True", expandable_max_batch_size=300)
    served = batch_size_headroom(headroom_summary(), healthy_setup(), simulated(device_max_batch_size=300, fit=(row,)))
    assert served is not None and served.title == "A batch of up to 300 fits, replayed (now 32): the GPU is underused"
    assert "the simulated caching allocator (expandable_segments:True) serves" in served.evidence
    assert "10%" not in served.evidence


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
        " Half the batch with accumulate_grad_batches=2 sums the gradients of two halves: the same as the whole"
        " batch's up to float32 rounding (about 1e-6 relative) where the loss is a mean over the batch's samples (a"
        " mean over the tokens ignore_index keeps, whose count differs between the halves, a summed loss, which the"
        " accumulation halves, or a loss comparing the batch's samples, in-batch negatives, trains another model)."
    )
    assert (advice.estimated_saving_bytes, advice.saving_basis, advice.predicted_peak_bytes) == (
        6 * GIB,
        "simulated",
        9 * GIB,
    )


def test_near_capacity_says_whether_the_simulated_allocator_serves_the_halved_batch() -> None:
    """16 GiB less a 300 MiB context: a 9 GiB request is served (one segment of 9 GiB, 2 MiB-rounded); a 15.75 GiB
    one is not, though it saves memory."""
    full = Breakdown(parameters=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=8 * GIB, other=3 * GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB, full))

    def advised(request_bytes: int) -> str:
        halved = replayed(BatchSizeChange(16), 9 * GIB)
        assert halved.replayed is not None
        kept = replace(halved.replayed, allocations=(Phase.FORWARD, ("malloc", 1, request_bytes, 0)), allocator="")
        simulation = simulated(replace(halved, replayed=kept), baseline=step(14 * GIB, 15 * GIB))
        advice = near_capacity(summary, healthy_setup(), simulation)
        assert advice is not None
        return advice.detail

    assert (
        "halve the batch to 16 (with accumulate_grad_batches=2), served by the simulated allocator (reserved"
        " 9.00 GiB): about 6.00 GiB" in advised(9 * GIB)
    )
    assert "(with accumulate_grad_batches=2), still not served by the simulated allocator: about 6.00 GiB" in advised(
        16 * GIB - 256 * MIB
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
