"""Advice from this run's measurements: pure rules over the run's summary, set-up and replayed step.

Each rule reads a :class:`RunSummary`, a :class:`TrainingSetup` and the replay of the run's step (a
:class:`Simulation`, or ``None``).

Every rule returns one :class:`Advice` with the figures that fired it and the saving it expects, or ``None``.
Where the simulation replayed the rule's change on the run's own step (and its baseline matched the measured step),
the saving is the replayed one (``saving_basis="simulated"``, with the predicted peak); a change whose replay saves
less than the rule's threshold is not advised, and one whose replay raised is never advised. Without such a replay
the saving is modelled from the measurements (``saving_basis="modelled"``). A rule whose evidence was not measured
here (no GPU, no NVML, no sampled step) stays silent; so does a rule whose saving would be too small to matter.
Thresholds are the named constants below (the README gives the reason for each).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.simulated import Discarded, Replayed, trial, trusted
from lightning_vram.records import (
    Advice,
    BatchSizeChange,
    Breakdown,
    CheckpointChange,
    CheckpointPlan,
    FitRow,
    FreeGradientsChange,
    InplaceChange,
    ModuleProfile,
    Phase,
    PhasePeak,
    PrecisionChange,
    ReplayedStep,
    RunSummary,
    Simulation,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

GIB = 1024**3
MIB = 1024**2

MIN_SAVING_SHARE = 0.05
"""Advice that would save less than this share of the peak is noise next to run-to-run variation."""
CHECKPOINT_MIN_SAVING_SHARE = 0.10
"""Checkpointing costs about one extra forward pass per step: advise it only for a tenth of the peak or more."""
INPLACE_MIN_SHARE = 0.02
"""Inplace activations save one saved tensor each: small, but free; advise it from 2% of the peak."""
DATA_WAIT_WORKERS_SHARE = 0.10
"""A GPU idle a tenth of every step waiting for data is worth more DataLoader workers."""
DATA_WAIT_PIN_SHARE = 0.05
"""Pinned memory is a one-word change; advise it from 5% of step time (the bar of TensorBoard's old profiler plugin)."""
DATA_WAIT_MIN_SECONDS = 0.002
"""...and from 2 ms of waiting per step: Lightning's own loop takes about 0.5 ms between batches (measured on a
small CPU, with fast in-memory data), which no DataLoader setting removes."""
MIN_TIMED_STEPS = 10
"""Data-wait rules need at least this many timed steps, so one slow start does not fire them."""
FRAGMENTATION_SHARE = 0.25
"""Cached-but-unused memory above this share of the reserve at the peak suggests fragmentation..."""
FRAGMENTATION_MIN_BYTES = 256 * MIB
"""...when it is also this large in absolute terms."""
HEADROOM_MAX_PEAK_SHARE = 0.5
"""A peak under half the capacity leaves room for at least twice the batch."""
HEADROOM_MAX_UTILIZATION_PERCENT = 70.0
"""Above this utilization a larger batch mostly makes each step longer, not the run shorter."""
NEAR_CAPACITY_SHARE = 0.9
"""A peak above 90% of capacity is one larger batch or input away from out-of-memory."""
BATCH_SAFETY_MARGIN = 0.10
"""Share of capacity kept free when predicting the largest batch (allocator rounding, other processes)."""
DEFAULT_CUDA_CONTEXT_BYTES = 512 * MIB
"""CUDA context and library workspaces when NVML could not measure them (typically a few hundred MiB)."""
TENSOR_CORE_CAPABILITY = (7, 0)
"""CUDA compute capability from which GPUs have tensor cores (Volta); mixed precision is advised for speed there."""
AUTOCAST_MEMORY = (
    "Autocast does not halve activations: it saves 16-bit copies of the weights for backward and keeps"
    " normalisation, softmax and the loss in float32."
)
"""Why mixed precision promises no memory saving that a replay has not shown."""
CHUNKED_LOSS_MIN_SHARE = 0.25
"""The loss's own saved tensors must be a quarter of the forward pass's activations to be worth chunking."""
LOSS_CHUNKS = 8
"""Chunks the chunked-loss advice computes the loss in: one eighth of its log-probabilities kept at a time."""
EIGHT_BIT_ADAM_STATE_SHARE = 0.25
"""8-bit Adam keeps 2 bytes of state per parameter instead of 8."""
SHOWN_REASON_CHARACTERS = 160
"""How much of a discarded replay's reason the evidence quotes (an exception's text can be long)."""
MODELLED_CHECKPOINT = (
    "saving modelled storage by storage from the sampled step's saved tensors (not replayed): each checkpointed"
    " unit keeps its input, and backward recomputes one unit at a time"
)
"""How the checkpointing advice's evidence says its saving is known, when no candidate plan was replayed."""

SHARDING_STRATEGIES = frozenset({"FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"})
"""Lightning strategies whose optimizer state is already sharded: the counts are this rank's shard."""
ADAM_FAMILY = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "FusedAdam"})
FULL_PRECISIONS = frozenset({"32-true", "32", "64-true", "64"})
COMMON_GPUS: tuple[tuple[str, int], ...] = (
    ("RTX 3060 (12 GiB)", 12 * GIB),
    ("T4 (16 GiB)", 16 * GIB),
    ("RTX 3090 / 4090, A10, L4 (24 GiB)", 24 * GIB),
    ("A100 40GB", 40 * GIB),
    ("A100 80GB / H100 80GB", 80 * GIB),
    ("H200 (141 GiB)", 141 * GIB),
)
"""Nominal capacities of cards people commonly train on or rent; the safety margin covers what they lack of it."""

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def _attributed_peak(summary: RunSummary) -> tuple[PhasePeak, Breakdown] | None:
    peak = summary.peak
    if peak is None or peak.breakdown is None or peak.peak_bytes <= 0:
        return None
    return peak, peak.breakdown


def _share(part: int, whole: int) -> str:
    return format_percent(part / whole) if whole else "n/a"


def _replay_evidence(replayed: Replayed) -> str:
    """The replayed peaks before and after a change, in words."""
    before, after = replayed.baseline.reported_peak, replayed.predicted.reported_peak
    measure = "allocator peak" if replayed.device_type == "cuda" else "peak of the counted parts"
    return (
        f"replayed on this run's step, {replayed.change.label} takes the {measure} from"
        f" {format_bytes(replayed.baseline_bytes)} in {before.phase.value} to {format_bytes(replayed.predicted_bytes)}"
        f" in {after.phase.value}"
    )


def _discarded_text(discarded: list[Discarded]) -> str:
    """The changes the replay discarded, each with its (shortened) reason; empty without any."""
    texts = []
    for item in discarded:
        reason = item.reason
        if len(reason) > SHOWN_REASON_CHARACTERS:
            reason = reason[: SHOWN_REASON_CHARACTERS - 1] + "…"
        texts.append(f"; not advised, its replay raised: {item.change.label} ({reason})")
    return "".join(texts)


def _code_path(name: str, forward_of: str) -> str:
    """Module ``name`` as code in the forward of ``forward_of``.

    >>> _code_path("transformer.h.3", "transformer"), _code_path("network.conv1", "")
    ('self.h[3]', 'self.network.conv1')
    """
    relative = name[len(forward_of) + 1 :] if forward_of else name
    return "self" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in relative.split("."))


def _unit_call(unit: tuple[str, ...], forward_of: str) -> str:
    """The callable ``checkpoint`` gets for one unit: the module, or a lambda running its modules in order."""
    if len(unit) == 1:
        return _code_path(unit[0], forward_of)
    call = "t"
    for name in unit:
        call = f"{_code_path(name, forward_of)}({call})"
    return f"lambda t: {call}"


CHECKPOINT_LINES = 6
"""Units spelled out one line each in the advice's code; the rest are named."""


def checkpoint_snippet(plan: CheckpointPlan) -> tuple[str, str]:
    """What the plan checkpoints, in words (for the title), and the code to write (for the detail)."""
    forward_of = plan.forward_of or ""
    where = f"the forward of `{forward_of}`" if forward_of else "the LightningModule's forward (or training_step)"
    if plan.sequential_segments is not None:
        path = _code_path(plan.container, forward_of)
        what = f"`{plan.container}` (an nn.Sequential) in {plan.sequential_segments} segments"
        code = (
            "from torch.utils.checkpoint import checkpoint_sequential\n"
            f"# in {where}, instead of {path}(x); the last segment runs without checkpointing:\n"
            f"x = checkpoint_sequential({path}, segments={plan.sequential_segments}, input=x, use_reentrant=False)"
        )
        return what, code
    first, last = plan.units[0][0], plan.units[-1][-1]
    what = (
        f"`{first}`"
        if len(plan.units) == 1
        else f"{len(plan.units)} units of {f'`{plan.container}`' if plan.container else 'the model'}, `{first}` to"
        f" `{last}`"
    )
    indices = [unit[0].rsplit(".", 1)[-1] for unit in plan.units]
    if plan.container != forward_of and all(len(unit) == 1 for unit in plan.units) and all(map(str.isdigit, indices)):
        loop = _code_path(plan.container, forward_of)
        code = (
            "from torch.utils.checkpoint import checkpoint\n"
            f"# in {where}, in its loop over {loop}:\n"
            f"for index, block in enumerate({loop}):\n"
            f"    x = checkpoint(block, x, use_reentrant=False) if {indices[0]} <= index <= {indices[-1]} else block(x)"
        )
        return what, code
    lines = [f"x = checkpoint({_unit_call(unit, forward_of)}, x, use_reentrant=False)" for unit in plan.units]
    if len(lines) > CHECKPOINT_LINES:
        rest = ", ".join(f"`{unit[0]}`" for unit in plan.units[CHECKPOINT_LINES:])
        lines = [*lines[:CHECKPOINT_LINES], f"# ... and the same for {rest}"]
    merged = [f"`{name}`" for unit in plan.units for name in unit[1:]]
    note = (
        f"# ({', '.join(merged)} run(s) inplace: each stays in the unit before it, which recomputes it)\n"
        if merged
        else ""
    )
    code = (
        "from torch.utils.checkpoint import checkpoint\n"
        f"# in {where}, replace the call of each unit by (everything else runs as before):\n{note}" + "\n".join(lines)
    )
    return what, code


def activation_checkpointing(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """Activations hold the largest part of the peak and checkpointing some modules would free a tenth of it.

    Up to :data:`~lightning_vram.advice.checkpointing.CANDIDATE_PLANS` plans are candidates. Where the simulation
    replayed any of them, only a replayed plan can be advised (the one whose replay lowers the peak most); a plan
    whose replay raised would break backward and is never advised. Without a replay of any candidate, the best
    modelled plan is advised with its modelled saving.
    """
    attributed = _attributed_peak(summary)
    if attributed is None or attributed[1].largest_part != "activations":
        return None
    peak, breakdown = attributed
    candidates = checkpoint_candidates(summary.modules)
    trials = [(plan, trial(simulation, CheckpointChange(plan))) for plan in candidates]
    replayed = [(plan, found) for plan, found in trials if isinstance(found, Replayed)]
    discarded = [found for _, found in trials if isinstance(found, Discarded)]
    if replayed:
        plan, best = max(replayed, key=lambda pair: pair[1].saving_bytes)  # the first on a tie: best modelled
        if best.saving_bytes < CHECKPOINT_MIN_SAVING_SHARE * best.baseline_bytes:
            return None
        saving, predicted, basis_text = best.saving_bytes, best.predicted_bytes, _replay_evidence(best)
    elif discarded or not candidates:
        return None
    else:
        plan = candidates[0]
        if plan.saving_bytes < CHECKPOINT_MIN_SAVING_SHARE * peak.peak_bytes:
            return None
        saving, predicted, basis_text = plan.saving_bytes, None, MODELLED_CHECKPOINT
    top = sorted(summary.modules, key=lambda profile: -profile.activation_bytes)[:3]
    top_text = ", ".join(f"{profile.name} {format_bytes(profile.activation_bytes)}" for profile in top)
    what, code = checkpoint_snippet(plan)
    return Advice(
        id="activation-checkpointing",
        severity="info",
        title=f"Checkpoint {what} to free about {format_bytes(saving)}",
        detail=(
            "Activation checkpointing keeps only each unit's input in forward and recomputes the rest during"
            " backward, one unit at a time: about one extra forward pass of the checkpointed units for the memory."
            " No unit starts with an inplace op (backward would find its kept input overwritten).\n"
            f"```python\n{code}\n```"
        ),
        evidence=(
            f"activations are {_share(breakdown.activations, peak.peak_bytes)} of the {peak.phase.value} peak"
            f" ({format_bytes(breakdown.activations)} of {format_bytes(peak.peak_bytes)}); top modules: {top_text};"
            f" {basis_text}{_discarded_text(discarded)}"
        ),
        estimated_saving_bytes=saving,
        saving_basis="modelled" if predicted is None else "simulated",
        predicted_peak_bytes=predicted,
    )


def _is_activation(profile: ModuleProfile) -> bool:
    return profile.inplace is False and "Dropout" not in profile.type


def _inplace_profiles(summary: RunSummary, setup: TrainingSetup) -> list[ModuleProfile]:
    """Out-of-place activations whose inplace variant would merge their saved input with their saved output."""
    merging = set(setup.inplace_keeps_result)
    return [
        profile
        for profile in summary.modules
        if _is_activation(profile)
        and profile.name in merging
        and profile.input_saved_bytes > 0
        and profile.output_saved_for_backward
    ]


def inplace_candidates(summary: RunSummary, setup: TrainingSetup) -> tuple[str, ...]:
    """The modules inplace-activations would name: safe for autograd (no earlier op saved their input)."""
    return tuple(profile.name for profile in _inplace_profiles(summary, setup) if not profile.input_saved_for_backward)


def inplace_activations(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """Out-of-place activations that save their input while a later op saves their output: inplace, one tensor.

    Only activations whose inplace variant saves just its result count (``TrainingSetup.inplace_keeps_result``:
    LeakyReLU, ELU...); a ReLU saves its output already, so inplace it frees no saved memory, only a transient
    copy that the counts cannot show at the peak: it is not advised. The saving is the replayed one where the
    simulation made these modules inplace (a replay that raised means no advice), else the saved inputs merged.
    """
    attributed = _attributed_peak(summary)
    if attributed is None:
        return None
    peak, _ = attributed
    candidates = _inplace_profiles(summary, setup)
    safe = [profile for profile in candidates if not profile.input_saved_for_backward]
    if not safe:
        return None
    found = trial(simulation, InplaceChange(tuple(profile.name for profile in safe)))
    merged = sum(profile.input_saved_bytes for profile in safe)
    if isinstance(found, Discarded):
        return None
    if isinstance(found, Replayed):
        saving, predicted, basis_text = found.saving_bytes, found.predicted_bytes, _replay_evidence(found)
        enough = saving >= INPLACE_MIN_SHARE * found.baseline_bytes
    else:
        saving, predicted, basis_text = merged, None, "saving modelled: the saved inputs merged (not replayed)"
        enough = saving >= INPLACE_MIN_SHARE * peak.peak_bytes
    if not enough:
        return None
    unsafe = [profile.name for profile in candidates if profile.input_saved_for_backward]
    types = sorted({profile.type for profile in safe})
    largest = max(safe, key=lambda profile: profile.input_saved_bytes)
    evidence = (
        f"{len(safe)} activation module(s) run out of place ({', '.join(types)}), each saving its input for"
        f" backward while a later op saves its output: {format_bytes(merged)} of saved inputs,"
        f" {_share(merged, peak.peak_bytes)} of the peak (largest {largest.name},"
        f" {format_bytes(largest.input_saved_bytes)}); {basis_text}"
    )
    if unsafe:
        evidence += f"; left out because autograd saved their input for an earlier op: {', '.join(unsafe[:5])}"
    return Advice(
        id="inplace-activations",
        severity="info",
        title=f"Use inplace activations (e.g. `{largest.type}(inplace=True)`) in {len(safe)} module(s)",
        detail=(
            "Out of place, these activations save their input for backward and the next op saves their output:"
            " two tensors. Inplace, they compute the gradient from their result, so one tensor serves both. This is"
            " safe for autograd here (no earlier op saved these inputs), but whether an input is used again later,"
            " as in a residual connection, cannot be told from measurements: check that first.\n"
            f"```python\nnn.{largest.type}(inplace=True)\n```"
        ),
        evidence=evidence,
        estimated_saving_bytes=saving,
        saving_basis="modelled" if predicted is None else "simulated",
        predicted_peak_bytes=predicted,
    )


def mixed_precision(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """32-bit training on a CUDA GPU: 16-bit matmuls on tensor cores, and the memory the replay shows it frees.

    Autocast does not halve activations (it saves 16-bit copies of the weights for backward and keeps
    normalisation, softmax and the loss in float32), so no memory saving is promised unless the step was replayed
    in that precision and its peak fell by :data:`MIN_SAVING_SHARE` or more. Otherwise the advice is for speed, on
    devices with tensor cores (compute capability 7.0 or higher) only, and says what the replay found; a replay
    that raised, or one whose peak would rise to near the device's capacity, means no advice.
    """
    attributed = _attributed_peak(summary)
    if not summary.on_cuda or setup.precision not in FULL_PRECISIONS or attributed is None:
        return None
    peak, breakdown = attributed
    capability = summary.device.compute_capability
    use_bf16 = capability is not None and capability >= (8, 0)
    tensor_cores = capability is not None and capability >= TENSOR_CORE_CAPABILITY
    precision = "bf16-mixed" if use_bf16 else "16-mixed"
    found = trial(simulation, PrecisionChange(precision))
    if isinstance(found, Discarded):
        return None
    replay = found if isinstance(found, Replayed) else None
    saving = (
        replay.saving_bytes
        if replay is not None and replay.saving_bytes >= MIN_SAVING_SHARE * replay.baseline_bytes
        else None
    )
    capacity = summary.device.total_bytes
    rises_near_capacity = (
        replay is not None
        and capacity is not None
        and replay.saving_bytes < 0
        and replay.predicted_bytes >= NEAR_CAPACITY_SHARE * capacity
    )
    if rises_near_capacity or (saving is None and not tensor_cores):
        return None
    capability_text = f"compute capability {capability[0]}.{capability[1]}" if capability else "compute capability n/a"
    reason = "supports bfloat16, which needs no loss scaling" if use_bf16 else "has no fast bfloat16: use float16"
    if replay is not None:
        moved = f"{format_bytes(abs(replay.saving_bytes))} {'lower' if replay.saving_bytes >= 0 else 'higher'}"
        replayed = (
            f"replayed on this run's step in {precision}, the peak is {format_bytes(replay.predicted_bytes)} instead"
            f" of {format_bytes(replay.baseline_bytes)} ({moved})."
        )
        memory = (
            f"Memory is not the reason to change: {replayed} {AUTOCAST_MEMORY}"
            if saving is None
            else f"Memory: {replayed}"
        )
        evidence_tail = f"; {_replay_evidence(replay)}"
    else:
        memory = f"No memory saving is promised: the step was not replayed in {precision}. {AUTOCAST_MEMORY}"
        evidence_tail = "; not replayed in 16 bits, so no memory saving is estimated"
    speed = " and run matmuls on tensor cores" if tensor_cores else ""
    title = (
        f'Train with precision="{precision}" to lower the peak by about {format_bytes(saving)}{speed}'
        if saving is not None
        else f'Train with precision="{precision}" to run matmuls on tensor cores'
    )
    faster = ", which tensor cores run several times faster" if tensor_cores else ""
    return Advice(
        id="mixed-precision",
        severity="info",
        title=title,
        detail=(
            f"{summary.device.name} ({capability_text}) {reason}. Weights and optimizer state stay in float32;"
            f" matmuls and convolutions run in 16 bits{faster}. {memory}\n"
            f'```python\nTrainer(precision="{precision}")\n```'
        ),
        evidence=(
            f"training in {setup.precision} on {summary.device.name} ({capability_text}"
            f"{': tensor cores' if tensor_cores else ''}); activations are {format_bytes(breakdown.activations)}"
            f" of the {format_bytes(peak.peak_bytes)} {peak.phase.value} peak{evidence_tail}"
        ),
        estimated_saving_bytes=saving,
        saving_basis="simulated" if saving is not None else None,
        predicted_peak_bytes=replay.predicted_bytes if replay is not None else None,
    )


def _sustained_data_wait(summary: RunSummary, threshold: float) -> bool:
    run, recent, step = summary.data_wait_fraction, summary.recent_data_wait_fraction, summary.step_seconds_median
    return (
        summary.timed_steps >= MIN_TIMED_STEPS
        and run is not None
        and recent is not None
        and step is not None
        and run >= threshold
        and recent >= threshold
        and run * step >= DATA_WAIT_MIN_SECONDS
    )


def suggested_num_workers(cpu_cores_per_device: int) -> int:
    """Workers for one device's DataLoader: the cores it has, one left for the training process, at most 8.

    >>> suggested_num_workers(16), suggested_num_workers(2), suggested_num_workers(1)
    (8, 1, 1)
    """
    return max(1, min(8, cpu_cores_per_device - 1))


def dataloader_workers(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """The step waits for data a tenth of the time or more, sustained, with spare cores for workers."""
    if setup.num_workers is None or not _sustained_data_wait(summary, DATA_WAIT_WORKERS_SHARE):
        return None
    workers = suggested_num_workers(setup.cpu_cores_per_device)
    if workers <= setup.num_workers:
        return None
    wait = summary.data_wait_fraction or 0.0
    step = summary.step_seconds_median or 0.0
    pin = ", pin_memory=True" if summary.on_cuda else ""
    return Advice(
        id="dataloader-workers",
        severity="warning",
        title=f"Load data in parallel: DataLoader(num_workers={workers}, persistent_workers=True)",
        detail=(
            "Each step waits while the main process loads the next batch. Worker processes load batches ahead"
            " of time; persistent workers are not restarted every epoch.\n"
            f"```python\nDataLoader(dataset, batch_size=..., num_workers={workers}, persistent_workers=True{pin})\n```"
        ),
        evidence=(
            f"data wait is {format_percent(wait)} of step time over the run and"
            f" {format_percent(summary.recent_data_wait_fraction)} recently ({summary.timed_steps} timed steps), about"
            f" {1000 * step * wait:.1f} ms per step;"
            f" num_workers={setup.num_workers}, {setup.cpu_cores_per_device} CPU cores per device"
        ),
        estimated_saving_bytes=None,
        estimated_saving_seconds=step * wait,
    )


def pin_memory(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """CUDA training with pin_memory off while the step measurably waits for data."""
    if not summary.on_cuda or setup.pin_memory is not False or not _sustained_data_wait(summary, DATA_WAIT_PIN_SHARE):
        return None
    return Advice(
        id="pin-memory",
        severity="info",
        title="Pin host memory: DataLoader(pin_memory=True)",
        detail=(
            "Pageable host memory is copied once more before the transfer to the GPU; pinned batches are copied"
            " straight away, and Lightning moves them with non_blocking transfers.\n"
            "```python\nDataLoader(dataset, batch_size=..., pin_memory=True)\n```"
        ),
        evidence=(
            f"data wait is {format_percent(summary.data_wait_fraction)} of step time on {summary.device.name};"
            " pin_memory=False. The transfer's own share of the wait is not measured separately."
        ),
        estimated_saving_bytes=None,
    )


def stale_gradients(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Last step's gradients are alive at a forward-phase peak under automatic optimization.

    The saving is the replayed one where the simulation set the gradients to ``None`` before forward (a replay that
    raised means no advice); otherwise modelled: the gradients, down to the next highest phase's peak.
    """
    attributed = _attributed_peak(summary)
    if not setup.automatic_optimization or attributed is None:
        return None
    peak, breakdown = attributed
    if peak.phase is not Phase.FORWARD or breakdown.gradients <= 0:
        return None
    next_highest = max((p.peak_bytes for phase, p in summary.phases.items() if phase is not Phase.FORWARD), default=0)
    found = trial(simulation, FreeGradientsChange())
    if isinstance(found, Discarded):
        return None
    if isinstance(found, Replayed):
        saving, predicted, basis_text = found.saving_bytes, found.predicted_bytes, _replay_evidence(found)
        enough = saving >= MIN_SAVING_SHARE * found.baseline_bytes
    else:
        saving = min(breakdown.gradients, peak.peak_bytes - next_highest)
        predicted, basis_text = None, "saving modelled: the gradients, down to the next highest phase (not replayed)"
        enough = saving >= MIN_SAVING_SHARE * peak.peak_bytes
    if not enough:
        return None
    return Advice(
        id="stale-gradients",
        severity="warning",
        title="Free the previous step's gradients before the forward pass",
        detail=(
            "Lightning zeroes gradients after training_step, so the last step's gradients stay allocated through"
            " the forward pass, where this run peaks. Free them at batch start, outside an accumulation window:\n"
            "```python\n"
            "def on_train_batch_start(self, batch, batch_idx):\n"
            "    if batch_idx % self.trainer.accumulate_grad_batches == 0:\n"
            "        for optimizer in self.trainer.optimizers:\n"
            "            optimizer.zero_grad(set_to_none=True)\n"
            "```"
        ),
        evidence=(
            f"the peak ({format_bytes(peak.peak_bytes)}) is in forward of step {peak.step}, with"
            f" {format_bytes(breakdown.gradients)} of gradients alive; the next highest phase peaks at"
            f" {format_bytes(next_highest)}; {basis_text}"
        ),
        estimated_saving_bytes=saving,
        saving_basis="modelled" if predicted is None else "simulated",
        predicted_peak_bytes=predicted,
    )


def _chunked_loss_peak(baseline: ReplayedStep, peak: PhasePeak, loss_bytes: int) -> int:
    """A replayed phase's peak with the loss computed in :data:`LOSS_CHUNKS` chunks, each recomputed in backward.

    Forward keeps none of the loss's log-probabilities (each chunk keeps only its inputs). Backward starts with the
    loss: where the phase's counted peak is at its start (no gradient yet), one chunk's are held again instead of
    all; a later backward peak is left as it is. The optimizer step holds no activations.
    """
    peak_bytes = baseline.reported_bytes(peak)
    if peak.phase is Phase.FORWARD:
        return peak_bytes - loss_bytes
    if peak.phase is Phase.BACKWARD and peak.breakdown is not None and peak.breakdown.gradients == 0:
        return peak_bytes - loss_bytes + loss_bytes // LOSS_CHUNKS
    return peak_bytes


def chunked_loss(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """The loss's own saved tensors (its log-probabilities over the classes or vocabulary) are a large share.

    Read from the replayed baseline (``ReplayedStep.loss_activation_bytes``): it fires where the loss holds
    :data:`CHUNKED_LOSS_MIN_SHARE` of the forward pass's activations and :data:`MIN_SAVING_SHARE` of the peak, and
    the modelled saving is as large. No replay applies the change, so the saving is modelled phase by phase from
    the replayed baseline (:func:`_chunked_loss_peak`). It counts the saved log-probabilities only: the logits and
    their gradient, also computed one chunk at a time, free more on a GPU.
    """
    baseline = trusted(simulation)
    if baseline is None:
        return None
    loss_bytes = baseline.loss_activation_bytes
    share = baseline.loss_activation_share
    peak = baseline.reported_peak
    peak_bytes = baseline.reported_bytes(peak)
    if share < CHUNKED_LOSS_MIN_SHARE or loss_bytes < MIN_SAVING_SHARE * peak_bytes:
        return None
    saving = peak_bytes - max(_chunked_loss_peak(baseline, phase, loss_bytes) for phase in baseline.phases.values())
    if saving < MIN_SAVING_SHARE * peak_bytes:
        return None
    return Advice(
        id="chunked-loss",
        severity="info",
        title=f"Compute the loss in chunks to lower the peak by about {format_bytes(saving)}",
        detail=(
            "Cross-entropy keeps the log-probabilities of every position over every class (the vocabulary of a"
            " language model) for backward, in float32. Computed chunk by chunk over the positions, each chunk"
            " recomputed in backward, it keeps one chunk's at a time; a fused linear cross-entropy kernel"
            " (Liger-Kernel's LigerFusedLinearCrossEntropyLoss) does the same without materialising the logits.\n"
            "```python\n"
            "import torch.nn.functional as F\n"
            "from torch.utils.checkpoint import checkpoint\n\n"
            f"def chunked_cross_entropy(hidden, head, targets, chunks={LOSS_CHUNKS}):\n"
            "    # hidden: (positions, width), the input of the output layer `head`; targets: (positions,)\n"
            "    def chunk_loss(h, t):\n"
            '        return F.cross_entropy(head(h).float(), t, reduction="sum")\n'
            "    total = sum(checkpoint(chunk_loss, h, t, use_reentrant=False)\n"
            "                for h, t in zip(hidden.chunk(chunks), targets.chunk(chunks)))\n"
            "    return total / targets.numel()  # with ignore_index, divide by the targets counted instead\n"
            "```"
        ),
        evidence=(
            f"replayed on this run's step: the loss's own ops saved {format_bytes(loss_bytes)},"
            f" {format_percent(share)} of the forward pass's activations and {_share(loss_bytes, peak_bytes)} of the"
            f" replayed {peak.phase.value} peak ({format_bytes(peak_bytes)}); saving modelled (not replayed): none of"
            f" them kept in forward, one chunk of {LOSS_CHUNKS} recomputed at a time in backward"
        ),
        estimated_saving_bytes=saving,
        saving_basis="modelled",
    )


def optimizer_state(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """Optimizer state is the largest part of the peak: name smaller or sharded alternatives with their savings."""
    attributed = _attributed_peak(summary)
    if attributed is None or attributed[1].largest_part != "optimizer_state":
        return None
    peak, breakdown = attributed
    state = breakdown.optimizer_state
    options: list[tuple[int, str]] = []
    if any(name in ADAM_FAMILY for name in setup.optimizers):
        options.append((int(state * (1 - EIGHT_BIT_ADAM_STATE_SHARE)), "8-bit Adam (bitsandbytes.optim.Adam8bit)"))
        options.append((state // 2, "SGD with momentum (one buffer per parameter instead of two)"))
    sharded = setup.strategy in SHARDING_STRATEGIES  # then the state counted is already this rank's shard
    if not sharded and setup.world_size > 1:
        options.append((state - state // setup.world_size, f"shard it across {setup.world_size} devices (FSDP)"))
    elif not sharded:
        options.append((state // 2, "shard it with FSDP or DeepSpeed ZeRO: 1/N of it on each of N devices"))
    if not options:
        return None
    options.sort(reverse=True)
    listed = "; ".join(f"{text}: saves {format_bytes(saving)}" for saving, text in options)
    remedy = "shrink it" if sharded else "shrink or shard it"
    example = (
        ""
        if sharded
        else '\n```python\nTrainer(strategy="fsdp")  # with several GPUs: each holds 1/N of the optimizer state\n```'
    )
    return Advice(
        id="optimizer-state",
        severity="info",
        title=f"Optimizer state is the largest part of the peak ({format_bytes(state)}): {remedy}",
        detail=f"Options, largest saving first: {listed}.{example}",
        evidence=(
            f"optimizer state ({', '.join(setup.optimizers)}) is {format_bytes(state)},"
            f" {_share(state, peak.peak_bytes)} of the {peak.phase.value} peak; parameters"
            f" {format_bytes(breakdown.parameters)}, activations {format_bytes(breakdown.activations)}"
        ),
        estimated_saving_bytes=options[0][0],
        saving_basis="modelled",
    )


def large_linear(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """A Linear reads a flattened convolutional feature map: pooling it first removes most of the Linear's weights.

    Global average pooling over the map's ``positions`` (H x W) turns ``Linear(C * positions, N)`` into
    ``Linear(C, N)``: it removes ``(positions - 1) / positions`` of the weight, with their gradients and optimizer
    state (the model-state bytes per parameter byte measured at the peak). A weight tied to another module has
    no bytes of its own and is never advised here.
    """
    attributed = _attributed_peak(summary)
    if attributed is None or attributed[1].parameters <= 0:
        return None
    peak, breakdown = attributed
    maps = {profile.name: profile.input_feature_map for profile in summary.modules}
    candidates = []
    for layer in setup.linear_layers:
        feature_map = maps.get(layer.name)
        if feature_map is None or feature_map[1] <= 1 or layer.weight_bytes <= 0:
            continue
        removed = layer.weight_bytes - layer.weight_bytes // feature_map[1]
        candidates.append((removed, layer, feature_map))
    if not candidates:
        return None
    removed, layer, (channels, positions) = max(candidates, key=lambda candidate: candidate[0])
    model_state = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state
    saving = removed * model_state // breakdown.parameters
    if saving < MIN_SAVING_SHARE * peak.peak_bytes:
        return None
    return Advice(
        id="large-linear",
        severity="info",
        title=(
            f"`{layer.name}` reads a flattened feature map of {positions} positions: pool it first to save"
            f" about {format_bytes(saving)}"
        ),
        detail=(
            f"Global average pooling before it averages each of the {channels} channels over the map's {positions}"
            f" positions, so Linear({layer.in_features}, {layer.out_features}) becomes"
            f" Linear({channels}, {layer.out_features}) and its weight, gradients and optimizer state shrink"
            f" {positions}-fold. Pooling drops where things are in the map: accuracy may change, so validate.\n"
            "```python\n"
            f"nn.Sequential(..., nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear({channels}, {layer.out_features}))"
            "  # AdaptiveAvgPool1d/3d for 1-D/3-D maps\n```"
        ),
        evidence=(
            f"{layer.name}: Linear({layer.in_features} -> {layer.out_features}) reads the flattened output of a"
            f" convolutional map of {channels} channels x {positions} positions; its weight is"
            f" {format_bytes(layer.weight_bytes)}, pooling removes {format_bytes(removed)} of it; parameters,"
            f" gradients and optimizer state are {model_state / breakdown.parameters:.2f}x the parameters at the"
            f" {peak.phase.value} peak ({format_bytes(peak.peak_bytes)})"
        ),
        estimated_saving_bytes=saving,
        saving_basis="modelled",
    )


def allocator_fragmentation(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """The allocator reserves far more than the peak allocation, or had to retry allocations."""
    peak = summary.peak
    if not summary.on_cuda or peak is None or peak.reserved_bytes is None:
        return None
    cached = max(peak.reserved_bytes - peak.peak_bytes, 0)
    retries = summary.alloc_retries or 0
    fragmented = cached >= FRAGMENTATION_SHARE * peak.reserved_bytes and cached >= FRAGMENTATION_MIN_BYTES
    if not fragmented and retries == 0:
        return None
    return Advice(
        id="allocator-fragmentation",
        severity="warning",
        title="Let the allocator grow segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        detail=(
            "The caching allocator keeps freed blocks; when sizes vary, blocks cannot be reused and the reserve"
            " grows beyond what tensors need. Expandable segments map memory as needed instead.\n"
            "```bash\nPYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py\n```"
        ),
        evidence=(
            f"reserved {format_bytes(peak.reserved_bytes)} at the peak while {format_bytes(peak.peak_bytes)} were"
            f" allocated ({format_bytes(cached)} cached, {_share(cached, peak.reserved_bytes)} of the reserve);"
            f" {retries} allocation retries"
        ),
        estimated_saving_bytes=cached,
        saving_basis="modelled",
    )


def predict_max_batch_size(summary: RunSummary, capacity_bytes: int) -> int | None:
    """The largest batch of this run predicted to fit in ``capacity_bytes``, from the measured costs.

    Fixed cost: parameters, gradients, optimizer state and the CUDA context. Per-sample cost: activations
    and ``other`` at the peak divided by the batch size. A ``BATCH_SAFETY_MARGIN`` of capacity stays free.
    """
    attributed = _attributed_peak(summary)
    if attributed is None or summary.batch_size is None or summary.batch_size <= 0:
        return None
    _, breakdown = attributed
    if breakdown.other is None:
        return None
    per_sample = (breakdown.activations + breakdown.other) / summary.batch_size
    context = summary.cuda_context_bytes if summary.cuda_context_bytes is not None else DEFAULT_CUDA_CONTEXT_BYTES
    fixed = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state + context
    usable = capacity_bytes * (1 - BATCH_SAFETY_MARGIN) - fixed
    if per_sample <= 0 or usable <= 0:
        return 0 if usable <= 0 else None
    return int(usable // per_sample)


def fit_table(summary: RunSummary, simulation: Simulation | None = None) -> tuple[FitRow, ...]:
    """The largest batch of this run per GPU of :data:`COMMON_GPUS`: replayed where the simulation searched it.

    Replayed rows (``basis`` ``"simulated"``) come from a trusted simulation's ``fit``; otherwise each row is
    modelled linearly from the measured peak (``basis`` ``"modelled"``, CUDA runs only).
    """
    if trusted(simulation) is not None and simulation is not None and simulation.fit:
        return tuple(replace(row, basis="simulated") for row in simulation.fit)
    if not summary.on_cuda:
        return ()
    rows = []
    for name, capacity in COMMON_GPUS:
        batch = predict_max_batch_size(summary, capacity)
        if batch is None:
            return ()
        rows.append(FitRow(name, capacity, batch, basis="modelled"))
    return tuple(rows)


def batch_size_headroom(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """The peak is under half the device, the GPU is not busy, and the data keeps up: a larger batch fits.

    The largest batch is the replayed one (``Simulation.device_max_batch_size``, found by replaying batch sizes)
    where the simulation searched it, else modelled linearly from the measured peak.
    """
    attributed = _attributed_peak(summary)
    capacity = summary.device.total_bytes
    utilization = summary.gpu_utilization_mean
    if not summary.on_cuda or attributed is None or capacity is None or summary.batch_size is None:
        return None
    peak, _ = attributed
    if peak.peak_bytes >= HEADROOM_MAX_PEAK_SHARE * capacity:
        return None
    if utilization is None or utilization >= HEADROOM_MAX_UTILIZATION_PERCENT:
        return None
    if summary.data_wait_fraction is None or summary.data_wait_fraction >= DATA_WAIT_WORKERS_SHARE:
        return None
    replayed = simulation.device_max_batch_size if simulation is not None and trusted(simulation) else None
    largest = replayed if replayed is not None else predict_max_batch_size(summary, capacity)
    if largest is None or largest < 2 * summary.batch_size:
        return None
    how = (
        "largest batch found by replaying this step at each batch size tried (a bisection)"
        if replayed is not None
        else "largest batch modelled linearly from the measured peak (not replayed)"
    )
    return Advice(
        id="batch-size-headroom",
        severity="info",
        title=(
            f"A batch of up to {largest} {'fits, replayed' if replayed is not None else 'should fit'}"
            f" (now {summary.batch_size}): the GPU is underused"
        ),
        detail=(
            "A larger batch gives each kernel more work. Raise it and scale the learning rate, or keep the batch"
            " and train a larger model. Once the GPU is busy, a larger batch makes steps longer, not training"
            " faster.\n"
            f"```python\nDataLoader(dataset, batch_size={largest})\n```"
        ),
        evidence=(
            f"peak {format_bytes(peak.peak_bytes)} of {format_bytes(capacity)} ({_share(peak.peak_bytes, capacity)});"
            f" GPU utilization {utilization:.0f}%; data wait {format_percent(summary.data_wait_fraction)}; {how},"
            f" keeping {format_percent(BATCH_SAFETY_MARGIN)} of the device free"
        ),
        estimated_saving_bytes=None,
    )


class Remedy(NamedTuple):
    """One way out of near-capacity: what to do, what it saves in bytes, and how that saving is known."""

    name: str
    saving_bytes: int
    basis: str
    predicted_peak_bytes: int | None


def _halved_batch(summary: RunSummary, breakdown: Breakdown, simulation: Simulation | None) -> Remedy | None:
    """Halving the batch: replayed where the simulation tried that batch, else half of what grows with the batch."""
    if summary.batch_size is None or summary.batch_size < 2:
        return None
    half = summary.batch_size // 2
    name = f"halve the batch to {half} (with accumulate_grad_batches=2)"
    found = trial(simulation, BatchSizeChange(half))
    if isinstance(found, Replayed):
        return Remedy(name, found.saving_bytes, "simulated", found.predicted_bytes)
    if breakdown.other is None:
        return None
    return Remedy(name, (breakdown.activations + breakdown.other) // 2, "modelled", None)


def near_capacity(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """The peak is above 90% of the device, or the allocator retried or ran out: list the remedies, largest first.

    Each remedy is another rule's advice (:data:`NEAR_CAPACITY_REMEDIES`) or a halved batch, with its saving
    simulated where the replay tried it, and its basis named.
    """
    attributed = _attributed_peak(summary)
    capacity = summary.device.total_bytes
    if not summary.on_cuda or attributed is None or capacity is None:
        return None
    peak, breakdown = attributed
    retries = summary.alloc_retries or 0
    ooms = summary.recovered_ooms or 0
    if peak.peak_bytes < NEAR_CAPACITY_SHARE * capacity and retries == 0 and ooms == 0:
        return None
    remedies = [
        Remedy(advice.id, advice.estimated_saving_bytes, advice.saving_basis or "modelled", advice.predicted_peak_bytes)
        for rule in NEAR_CAPACITY_REMEDIES
        if (advice := rule(summary, setup, simulation)) is not None and advice.estimated_saving_bytes
    ]
    halved = _halved_batch(summary, breakdown, simulation)
    if halved is not None and halved.saving_bytes > 0:
        remedies.append(halved)
    remedies.sort(key=lambda remedy: -remedy.saving_bytes)
    listed = "; ".join(
        f"{remedy.name}: about {format_bytes(remedy.saving_bytes)} ({remedy.basis})" for remedy in remedies
    )
    best = remedies[0] if remedies else None
    return Advice(
        id="near-capacity",
        severity="critical",
        title=f"Memory is near capacity ({_share(peak.peak_bytes, capacity)} of the device): one step from OOM",
        detail=f"Remedies this run's measurements support, largest saving first: {listed or 'none measured'}.",
        evidence=(
            f"peak {format_bytes(peak.peak_bytes)} of {format_bytes(capacity)} in {peak.phase.value} of step"
            f" {peak.step}; {retries} allocation retries; {ooms} out-of-memory errors recovered from"
        ),
        estimated_saving_bytes=best.saving_bytes if best is not None else None,
        saving_basis=best.basis if best is not None else None,
        predicted_peak_bytes=best.predicted_peak_bytes if best is not None else None,
    )


def evaluation_batch_size(step: int, training_peak: PhasePeak | None) -> Advice:
    """Advice for an out-of-memory error in validation: evaluate with a smaller batch."""
    peak_text = (
        f"training peaked at {format_bytes(training_peak.peak_bytes)} ({training_peak.phase.value} of step"
        f" {training_peak.step})"
        if training_peak is not None
        else "no training step was measured before it"
    )
    return Advice(
        id="evaluation-batch-size",
        severity="critical",
        title="Validate with a smaller batch",
        detail=(
            "Lightning already runs validation without autograd, so no activations are kept for backward; what"
            " filled the device is the validation batch and its forward pass on top of the model state (and the"
            " cache training left). Give validation its own, smaller batch size:\n"
            "```python\ndef val_dataloader(self):\n"
            "    return DataLoader(val_set, batch_size=train_batch_size // 2)\n```"
        ),
        evidence=f"out of memory in validation after step {step}; {peak_text}",
        estimated_saving_bytes=None,
    )


Rule = Callable[[RunSummary, TrainingSetup, Simulation | None], Advice | None]
"""A rule: the run's summary, its training set-up and the replay of its step (``None`` without one) -> advice."""

NEAR_CAPACITY_REMEDIES: tuple[Rule, ...] = (
    activation_checkpointing,
    mixed_precision,
    inplace_activations,
    stale_gradients,
    chunked_loss,
    optimizer_state,
    allocator_fragmentation,
)
"""The rules whose savings near-capacity lists as remedies."""

RULES: tuple[Rule, ...] = (
    near_capacity,
    activation_checkpointing,
    mixed_precision,
    inplace_activations,
    chunked_loss,
    dataloader_workers,
    pin_memory,
    stale_gradients,
    optimizer_state,
    large_linear,
    allocator_fragmentation,
    batch_size_headroom,
)


def advise(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> tuple[Advice, ...]:
    """Every rule's advice for this run, most severe first, then by estimated saving.

    ``simulation`` is the replay of the run's sampled step and of the changes tried on it: where it replayed a
    change and its baseline matched, the rule's saving is the replayed one (``saving_basis`` ``"simulated"``).
    """
    found = [advice for rule in RULES if (advice := rule(summary, setup, simulation)) is not None]
    return tuple(
        sorted(found, key=lambda advice: (SEVERITY_ORDER[advice.severity], -(advice.estimated_saving_bytes or 0)))
    )
