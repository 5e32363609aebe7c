"""Advice from this run's measurements: pure rules over a :class:`RunSummary` and a :class:`TrainingSetup`.

Every rule returns one :class:`Advice` with the figures that fired it and the saving it expects, or ``None``.
A rule whose evidence was not measured here (no GPU, no NVML, no sampled step) stays silent; so does a rule
whose saving would be too small to matter. Thresholds are the named constants below (the README gives the
reason for each).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning_vram.records import (
    Advice,
    Breakdown,
    CheckpointPlan,
    FitRow,
    ModuleProfile,
    Phase,
    PhasePeak,
    RunSummary,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

GIB = 1024**3
MIB = 1024**2

MIN_SAVING_SHARE = 0.05
"""Advice that would save less than this share of the peak is noise next to run-to-run variation."""
CHECKPOINT_MIN_SAVING_SHARE = 0.10
"""Checkpointing costs about one extra forward pass per step: advise it only for a tenth of the peak or more."""
CHECKPOINT_SEGMENTS = (2, 3, 4, 6, 8)
"""Segment counts tried for ``checkpoint_sequential`` on an ``nn.Sequential``."""
INPLACE_MIN_SHARE = 0.02
"""An inplace activation saves one transient copy: small, but free; advise it from 2% of the peak."""
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
LARGE_LINEAR_SHARE = 0.5
"""One Linear holding more than half of the parameters usually flattens a large feature map."""
BATCH_SAFETY_MARGIN = 0.10
"""Share of capacity kept free when predicting the largest batch (allocator rounding, other processes)."""
DEFAULT_CUDA_CONTEXT_BYTES = 512 * MIB
"""CUDA context and library workspaces when NVML could not measure them (typically a few hundred MiB)."""
EIGHT_BIT_ADAM_STATE_SHARE = 0.25
"""8-bit Adam keeps 2 bytes of state per parameter instead of 8."""

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


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def activations_peak_with_checkpoints(units: list[tuple[int, int, bool]]) -> int:
    """Highest activation bytes of a chain of units, each ``(saved, input, checkpointed)``, over forward and backward.

    A checkpointed unit keeps only its input after forward; backward visits the units last to first,
    recomputing a checkpointed one, so while unit ``i`` is processed the earlier units hold what they kept and
    unit ``i`` holds everything it saves (later units are already freed).

    >>> activations_peak_with_checkpoints([(20, 1, True), (12, 2, False)])  # 32 without checkpoints
    20
    """
    kept_before = 0
    peak = 0
    for saved, input_bytes, checkpointed in units:
        peak = max(peak, kept_before + saved)
        kept_before += input_bytes if checkpointed else saved
    return max(peak, kept_before)


def best_checkpoint_plan(profiles: tuple[ModuleProfile, ...]) -> CheckpointPlan | None:
    """The checkpointing plan that frees the most activation bytes at the peak.

    Units are either all the children of one module, each checkpointed (``checkpoint(block, x)``), or the
    children of an ``nn.Sequential`` in contiguous segments, all but the last checkpointed, as
    ``checkpoint_sequential`` does. A unit's saved bytes include its submodules'; the saving is the units'
    saved bytes minus :func:`activations_peak_with_checkpoints` of them.
    """
    called = {profile.name: profile for profile in profiles if profile.name not in ("(root)", "(training_step)")}
    inclusive = dict.fromkeys(called, 0)
    for profile in called.values():
        name = profile.name
        while name:
            if name in inclusive:
                inclusive[name] += profile.activation_bytes
            name = _parent(name)
    children: dict[str, list[str]] = {}
    for name in called:
        children.setdefault(_parent(name), []).append(name)

    def plan(container: str, units: list[list[str]], segments: int | None) -> CheckpointPlan:
        chain = []
        for index, unit in enumerate(units):
            checkpointed = segments is None or index < len(units) - 1
            chain.append((sum(inclusive[name] for name in unit), called[unit[0]].input_bytes, checkpointed))
        saving = sum(saved for saved, _, _ in chain) - activations_peak_with_checkpoints(chain)
        return CheckpointPlan(container, tuple(tuple(unit) for unit in units), segments, saving)

    plans = []
    for container, names in children.items():
        if len(names) < 2:
            continue
        plans.append(plan(container, [[name] for name in names], None))
        container_profile = called.get(container)
        if container_profile is not None and container_profile.type == "Sequential":
            for segments in CHECKPOINT_SEGMENTS:
                if segments < len(names):
                    size = math.ceil(len(names) / segments)
                    units = [names[start : start + size] for start in range(0, len(names), size)]
                    plans.append(plan(container, units, len(units)))
    best = max(plans, key=lambda candidate: candidate.saving_bytes, default=None)
    return best if best is not None and best.saving_bytes > 0 else None


def activation_checkpointing(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """Activations hold the largest part of the peak and checkpointing some modules would free a tenth of it."""
    attributed = _attributed_peak(summary)
    if attributed is None or attributed[1].largest_part != "activations":
        return None
    peak, breakdown = attributed
    plan = best_checkpoint_plan(summary.modules)
    if plan is None or plan.saving_bytes < CHECKPOINT_MIN_SAVING_SHARE * peak.peak_bytes:
        return None
    top = sorted(summary.modules, key=lambda profile: -profile.activation_bytes)[:3]
    top_text = ", ".join(f"{profile.name} {format_bytes(profile.activation_bytes)}" for profile in top)
    container = plan.container or "the LightningModule"
    if plan.sequential_segments is not None:
        what = f"`{container}` (an nn.Sequential) in {plan.sequential_segments} segments"
        snippet = (
            "from torch.utils.checkpoint import checkpoint_sequential\n"
            f"x = checkpoint_sequential(self.{plan.container}, segments={plan.sequential_segments}, input=x,"
            " use_reentrant=False)"
        )
    else:
        names = [unit[0] for unit in plan.units]
        what = ", ".join(f"`{name}`" for name in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        snippet = (
            "from torch.utils.checkpoint import checkpoint\n"
            f"# in the forward of {container}, for each of its blocks:\n"
            "x = checkpoint(block, x, use_reentrant=False)"
        )
    return Advice(
        id="activation-checkpointing",
        severity="info",
        title=f"Checkpoint {what} to free about {format_bytes(plan.saving_bytes)} of activations",
        detail=(
            "Activation checkpointing keeps only each block's inputs in forward and recomputes the rest during"
            " backward, one block at a time: about one extra forward pass of compute for the memory.\n"
            f"```python\n{snippet}\n```"
        ),
        evidence=(
            f"activations are {_share(breakdown.activations, peak.peak_bytes)} of the {peak.phase.value} peak"
            f" ({format_bytes(breakdown.activations)} of {format_bytes(peak.peak_bytes)}); top modules: {top_text}"
        ),
        estimated_saving_bytes=plan.saving_bytes,
    )


def _is_activation(profile: ModuleProfile) -> bool:
    return profile.inplace is False and "Dropout" not in profile.type


def inplace_activations(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """Out-of-place activation modules whose output copy is a visible part of the peak."""
    attributed = _attributed_peak(summary)
    if attributed is None:
        return None
    peak, _ = attributed
    out_of_place = [profile for profile in summary.modules if _is_activation(profile)]
    safe = [profile for profile in out_of_place if not profile.input_saved_for_backward]
    if not safe:
        return None
    largest = max(safe, key=lambda profile: profile.output_bytes)
    if largest.output_bytes < INPLACE_MIN_SHARE * peak.peak_bytes:
        return None
    unsafe = [profile.name for profile in out_of_place if profile.input_saved_for_backward]
    types = sorted({profile.type for profile in safe})
    evidence = (
        f"{len(safe)} activation module(s) run out of place ({', '.join(types)}); the largest output is"
        f" {format_bytes(largest.output_bytes)} ({largest.name}), {_share(largest.output_bytes, peak.peak_bytes)}"
        " of the peak"
    )
    if unsafe:
        evidence += f"; left out because autograd saved their input for an earlier op: {', '.join(unsafe[:5])}"
    return Advice(
        id="inplace-activations",
        severity="info",
        title=f"Use inplace activations (e.g. `{largest.type}(inplace=True)`) in {len(safe)} module(s)",
        detail=(
            "An out-of-place activation allocates a new output while its input is still alive. Inplace, the"
            " transient copy goes away; the tensors saved for backward stay the same, so the peak drops by up to"
            " one such output only when the peak falls on it. Inplace is safe here for autograd (no earlier op"
            " saved these inputs), but whether the input is used again later, as in a residual connection, cannot"
            " be told from measurements: check that first.\n"
            f"```python\nnn.{largest.type}(inplace=True)\n```"
        ),
        evidence=evidence,
        estimated_saving_bytes=largest.output_bytes,
    )


def mixed_precision(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """32-bit training on a CUDA GPU, where 16-bit activations would halve a visible part of the peak."""
    attributed = _attributed_peak(summary)
    if not summary.on_cuda or setup.precision not in FULL_PRECISIONS or attributed is None:
        return None
    peak, breakdown = attributed
    saving = breakdown.activations // 2
    if saving < MIN_SAVING_SHARE * peak.peak_bytes:
        return None
    capability = summary.device.compute_capability
    use_bf16 = capability is not None and capability >= (8, 0)
    precision = "bf16-mixed" if use_bf16 else "16-mixed"
    capability_text = f"compute capability {capability[0]}.{capability[1]}" if capability else "compute capability n/a"
    reason = "supports bfloat16, which needs no loss scaling" if use_bf16 else "has no fast bfloat16: use float16"
    return Advice(
        id="mixed-precision",
        severity="info",
        title=f'Train with precision="{precision}" to halve activation memory and use tensor cores',
        detail=(
            f"{summary.device.name} ({capability_text}) {reason}. Weights and optimizer state stay in float32;"
            " activations and matmuls run in 16 bits, which tensor cores run several times faster.\n"
            f'```python\nTrainer(precision="{precision}")\n```'
        ),
        evidence=(
            f"training in {setup.precision} on {summary.device.name}; activations are"
            f" {format_bytes(breakdown.activations)} of the {format_bytes(peak.peak_bytes)} {peak.phase.value} peak"
        ),
        estimated_saving_bytes=saving,
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


def dataloader_workers(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
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


def pin_memory(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
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


def stale_gradients(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """Last step's gradients are alive at a forward-phase peak under automatic optimization."""
    attributed = _attributed_peak(summary)
    if not setup.automatic_optimization or attributed is None:
        return None
    peak, breakdown = attributed
    if peak.phase is not Phase.FORWARD or breakdown.gradients <= 0:
        return None
    next_highest = max((p.peak_bytes for phase, p in summary.phases.items() if phase is not Phase.FORWARD), default=0)
    saving = min(breakdown.gradients, peak.peak_bytes - next_highest)
    if saving < MIN_SAVING_SHARE * peak.peak_bytes:
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
            f" {format_bytes(next_highest)}"
        ),
        estimated_saving_bytes=saving,
    )


def optimizer_state(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
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
    )


def large_linear(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """One Linear holds most of the parameters, and with its gradients and state a visible part of the peak."""
    attributed = _attributed_peak(summary)
    if attributed is None or not setup.linear_layers or setup.parameter_bytes <= 0:
        return None
    peak, breakdown = attributed
    layer = max(setup.linear_layers, key=lambda linear: linear.parameter_bytes)
    share = layer.parameter_bytes / setup.parameter_bytes
    model_state = breakdown.parameters + breakdown.gradients + breakdown.optimizer_state
    footprint = int(share * model_state)
    if share <= LARGE_LINEAR_SHARE or footprint < MIN_SAVING_SHARE * peak.peak_bytes:
        return None
    return Advice(
        id="large-linear",
        severity="info",
        title=f"`{layer.name}` holds {format_percent(share)} of the parameters: pool before it or shrink it",
        detail=(
            f"A Linear({layer.in_features}, {layer.out_features}) usually reads a flattened feature map. Global"
            " average pooling before it divides its inputs by the map's area (H x W), and its weights,"
            " gradients and optimizer state with them.\n"
            "```python\nnn.Sequential(..., nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))\n```"
        ),
        evidence=(
            f"{layer.name}: Linear({layer.in_features} -> {layer.out_features}) has"
            f" {format_bytes(layer.parameter_bytes)} of {format_bytes(setup.parameter_bytes)} parameters; with its"
            f" gradients and optimizer state about {format_bytes(footprint)} of the"
            f" {format_bytes(peak.peak_bytes)} peak"
        ),
        estimated_saving_bytes=footprint,
    )


def allocator_fragmentation(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
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


def fit_table(summary: RunSummary) -> tuple[FitRow, ...]:
    """The largest batch of this run predicted to fit on each of :data:`COMMON_GPUS` (CUDA runs only)."""
    if not summary.on_cuda:
        return ()
    rows = []
    for name, capacity in COMMON_GPUS:
        batch = predict_max_batch_size(summary, capacity)
        if batch is None:
            return ()
        rows.append(FitRow(name, capacity, batch))
    return tuple(rows)


def batch_size_headroom(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """The peak is under half the device, the GPU is not busy, and the data keeps up: a larger batch fits."""
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
    largest = predict_max_batch_size(summary, capacity)
    if largest is None or largest < 2 * summary.batch_size:
        return None
    return Advice(
        id="batch-size-headroom",
        severity="info",
        title=f"A batch of up to {largest} should fit (now {summary.batch_size}): the GPU is underused",
        detail=(
            "A larger batch gives each kernel more work. Raise it and scale the learning rate, or keep the batch"
            " and train a larger model. Once the GPU is busy, a larger batch makes steps longer, not training"
            " faster.\n"
            f"```python\nDataLoader(dataset, batch_size={largest})\n```"
        ),
        evidence=(
            f"peak {format_bytes(peak.peak_bytes)} of {format_bytes(capacity)} ({_share(peak.peak_bytes, capacity)});"
            f" GPU utilization {utilization:.0f}%; data wait {format_percent(summary.data_wait_fraction)};"
            f" prediction keeps {format_percent(BATCH_SAFETY_MARGIN)} of the device free"
        ),
        estimated_saving_bytes=None,
    )


def near_capacity(summary: RunSummary, setup: TrainingSetup) -> Advice | None:
    """The peak is above 90% of the device, or the allocator retried or ran out: list the remedies, largest first."""
    attributed = _attributed_peak(summary)
    capacity = summary.device.total_bytes
    if not summary.on_cuda or attributed is None or capacity is None:
        return None
    peak, breakdown = attributed
    retries = summary.alloc_retries or 0
    ooms = summary.recovered_ooms or 0
    if peak.peak_bytes < NEAR_CAPACITY_SHARE * capacity and retries == 0 and ooms == 0:
        return None
    remedies: list[tuple[int, str]] = []
    for rule in (activation_checkpointing, mixed_precision, optimizer_state, allocator_fragmentation):
        advice = rule(summary, setup)
        if advice is not None and advice.estimated_saving_bytes:
            remedies.append((advice.estimated_saving_bytes, advice.id))
    if summary.batch_size is not None and summary.batch_size >= 2 and breakdown.other is not None:
        half = (breakdown.activations + breakdown.other) // 2
        remedies.append((half, f"halve the batch to {summary.batch_size // 2} (with accumulate_grad_batches=2)"))
    remedies.sort(reverse=True)
    listed = "; ".join(f"{name}: about {format_bytes(saving)}" for saving, name in remedies) or "none measured"
    return Advice(
        id="near-capacity",
        severity="critical",
        title=f"Memory is near capacity ({_share(peak.peak_bytes, capacity)} of the device): one step from OOM",
        detail=f"Remedies this run's measurements support, largest saving first: {listed}.",
        evidence=(
            f"peak {format_bytes(peak.peak_bytes)} of {format_bytes(capacity)} in {peak.phase.value} of step"
            f" {peak.step}; {retries} allocation retries; {ooms} out-of-memory errors recovered from"
        ),
        estimated_saving_bytes=remedies[0][0] if remedies else None,
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


RULES: tuple[Callable[[RunSummary, TrainingSetup], Advice | None], ...] = (
    near_capacity,
    activation_checkpointing,
    mixed_precision,
    inplace_activations,
    dataloader_workers,
    pin_memory,
    stale_gradients,
    optimizer_state,
    large_linear,
    allocator_fragmentation,
    batch_size_headroom,
)


def advise(summary: RunSummary, setup: TrainingSetup) -> tuple[Advice, ...]:
    """Every rule's advice for this run, most severe first, then by estimated saving."""
    found = [advice for rule in RULES if (advice := rule(summary, setup)) is not None]
    return tuple(
        sorted(found, key=lambda advice: (SEVERITY_ORDER[advice.severity], -(advice.estimated_saving_bytes or 0)))
    )
