"""DeepSpeed ZeRO 1, 2 and 3: one rank at any world size, by ZeRO's arithmetic on the single-process replay.

DeepSpeed 0.19 trains a step under torch's fake process group with real tensors (``LOCAL_RANK`` set), not with
fake ones: ``deepspeed.initialize`` under ``FakeTensorMode`` raises ``RuntimeError: _apply(): Couldn't swap
NonDynamicallyQuantizableLinear.weight`` (torch: "Cannot swap t1 because it has weakref associated with it"), so no
replay runs its code: each figure is the strategy's arithmetic on the single-process replay of one rank's batch (the
activations and the step's temporaries) and on the module's parameters in order (what ZeRO flattens). Checked
against DeepSpeed 0.19 on gloo at world sizes 2 and 4 (tests/test_rank_prediction_zero.py); the monitor counts:

- ZeRO-1 and 2 (one flat buffer per optimizer param group, padded to a multiple of ``2 N`` elements,
  ``nccl_start_alignment_factor`` 2): the whole parameters; gradients none in forward (freed at the step), one
  reduce bucket of ``reduce_bucket_size`` elements in backward (``contiguous_gradients``: ``param.grad`` is a view of
  it), this rank's ``1/N`` partition at the step plus the whole gradient of each parameter that crosses the
  partition's edges (DeepSpeed copies its slice in and keeps the gradient); optimizer state: the fp32 master
  partition and the user's optimizer's state over that one flat partition. ZeRO-1 and ZeRO-2 hold the same there
  (DeepSpeed 0.19 reduces ZeRO-1's gradients through the same buckets).
- ZeRO-3: every parameter partitioned, ``ceil(numel / N)`` elements each, and its gradient partition held the whole
  run (``grad_partitions_flat_buffer``), plus the reduce bucket in backward; parameters a module uses directly
  while it has submodules (``nn.MultiheadAttention``'s packed in-projection) are gathered into a storage of their
  own that autograd saves: counted as activations.

Backward's activations are the forward's less what the loss and the last module release before backward's first
count. The peaks (fitted on those runs, Adam): forward, the counted parts (ZeRO-1/2; the CPU's live count misses the
master partition) or those and the step's own temporaries (ZeRO-3 under accumulation); backward, ZeRO-1/2 rank by
rank, op by op over the replay's backward (:mod:`~lightning_vram.prediction.strategies._zero_buckets`: both reduce
buckets, the rank's ``grads_in_partition`` from the first bucket reduce that reaches its partition, ZeRO-1's whole
gradients under accumulation; without a timeline, the counted parts and the step's temporaries, at least the second
bucket); ZeRO-3's forward and backward, the parameters it gathers whole and holds from each module's forward to its
backward and one all-gather's buffer beside the replay's activations and temporaries, op by op over backward
(:mod:`~lightning_vram.prediction.strategies._zero3_peaks`; under accumulation, the counted parts in backward); the
optimizer step, the partition's gradients, one partition-sized temporary of the optimizer's and the batch beside the
parameters and state (ZeRO-3: and the reduce bucket).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_vram.measure.deepspeed_zero import full_numel
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies._shards import (
    backward_activations,
    batch_bytes,
    cpu_step_bytes,
    flat_state_bytes,
    other_bytes,
    padded,
    parameter_numels,
    phase_peak,
    shard_communication,
    step_optimizer,
)
from lightning_vram.prediction.strategies._zero3_peaks import (
    backward_live,
    forward_live,
    last_module_bytes,
    unseen_partitions,
)
from lightning_vram.prediction.strategies._zero_buckets import BucketModel
from lightning_vram.records import (
    Phase,
    PrecisionChange,
    RankLine,
    RankStep,
    ReplayedStep,
    ReplaySkipped,
    StepChange,
    StrategySpec,
)

FP32 = 4
"""Bytes of an fp32 element: ZeRO's master copy and its optimizer state."""
ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: ZeRO-1/2's flat buffer is padded to ``ALIGNMENT x N`` elements."""
METHOD = (
    "arithmetic on the single-process replay: ZeRO's partitions (DeepSpeed 0.19 refuses fake tensors), sized from"
    " the module's parameters in order"
)
"""How a ZeRO rank is predicted."""


@dataclass(frozen=True)
class ZeroSettings:
    """The ``zero_optimization`` settings the arithmetic reads, in elements; defaults: Lightning's DeepSpeedStrategy.

    ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` are DeepSpeed's own defaults (Lightning sets
    neither).
    """

    reduce_bucket_size: int = 200_000_000
    allgather_bucket_size: int = 200_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    overlap_comm: bool = True


Phases = dict[Phase, tuple[tuple[int, int, int, int], int]]
"""Each phase's counted parts (parameters, gradients, optimizer state, activations) and the bytes beyond them."""


LIGHTNING_DEFAULTS = ZeroSettings()
"""What ``DeepSpeedStrategy(stage=...)`` writes into the config."""


def element_bytes(precision: str) -> int:
    """Bytes of a parameter element DeepSpeed trains in: 2 under Lightning's 16-bit precisions, else 4."""
    return 2 if precision.startswith(("16", "bf16")) else FP32


def group_numels(predictor: Predictor) -> list[list[int]]:
    """Each optimizer param group's parameter sizes (elements, in order): what ZeRO flattens, group by group."""
    optimizer = step_optimizer(predictor)
    if optimizer is None:
        return [parameter_numels(predictor.module)]
    return [[full_numel(p) for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]


def crossing_bytes(numels: Sequence[int], start: int, end: int, element: int) -> int:
    """Bytes of the gradients outside ``[start, end)`` of the parameters that cross either edge of it.

    ``numels`` are laid out one after the other from element 0 (a ZeRO-1/2 flat buffer); a parameter that starts
    before an edge and ends after it keeps its whole gradient on the rank whose partition holds part of it.

    >>> crossing_bytes([10, 10, 10], 5, 15, 4)  # the first two cross: 5 + 5 elements outside
    40
    """
    offsets = list(itertools.accumulate(numels, initial=0))
    outside = 0
    crossing: set[int] = set()
    for edge in (start, end):
        index = bisect.bisect_right(offsets, edge) - 1
        if 0 <= index < len(numels) and offsets[index] < edge < offsets[index + 1]:
            crossing.add(index)
    for index in crossing:
        inside = min(offsets[index + 1], end) - max(offsets[index], start)
        outside += numels[index] - inside
    return outside * element


def fetched_numel(module: nn.Module) -> int:
    """Elements of the parameters ``module`` holds itself (ZeRO-3 gathers them together at its fetch)."""
    return sum(full_numel(parameter) for parameter in module.parameters(recurse=False))


def gathered_direct_bytes(module: nn.Module, element: int) -> int:
    """Bytes of the parameters held directly by modules that have submodules (ZeRO-3 gathers them apart)."""
    total = 0
    for child in module.modules():
        if next(child.children(), None) is not None:
            total += sum(full_numel(p) for p in child.parameters(recurse=False) if p.requires_grad) * element
    return total


def replay_element(predictor: Predictor) -> int:
    """Bytes of a gradient element in the single-process replay: the first trainable parameter's (4 without one)."""
    return next((p.element_size() for p in predictor.module.parameters() if p.requires_grad), FP32)


def _stage12(
    predictor: Predictor,
    replayed: ReplayedStep,
    spec: StrategySpec,
    settings: ZeroSettings,
    rank: int | None,
    element: int,
) -> tuple[Phases, tuple[RankLine, ...], int]:
    world = spec.world_size
    optimizer = step_optimizer(predictor)
    parameters = gradients = state = master = 0
    partition = 0
    shares = []
    for numels in group_numels(predictor):
        flat = padded(sum(numels), ALIGNMENT * world)
        share = flat // world
        shares.append(share)
        parameters += flat * element
        partition += share * element
        master += share * FP32
        state += share * FP32 + flat_state_bytes(optimizer, share)
        ranks = range(world) if rank is None else (rank,)
        crossing = max(crossing_bytes(numels, r * share, (r + 1) * share, element) for r in ranks)
        gradients += share * element + crossing
    bucket = settings.reduce_bucket_size * element
    buckets = 2 if settings.overlap_comm else 1
    # ZeRO-1 accumulating: each parameter's whole gradient stays in param.grad until the window's boundary, where it
    # is reduced; ZeRO-2 reduces every micro-batch into its partition, holding what it holds without accumulation.
    accumulating = predictor.accumulate > 1
    held = WINDOW_HELD.get(spec.name, 0) * element * sum(map(sum, group_numels(predictor))) if accumulating else 0
    forward_activations = replayed.phases[Phase.FORWARD].breakdown.activations  # type: ignore[union-attr]
    backward_parts = (parameters, held + bucket, state, backward_activations(replayed))
    # beyond the counted parts: the step's temporaries, or at least the idle bucket
    backward_other = max(other_bytes(replayed, Phase.BACKWARD), (buckets - 1) * bucket)
    buckets_held = BucketModel(
        group_numels(predictor),
        shares,
        settings.reduce_bucket_size,
        element,
        replay_element(predictor),
        stage=int(spec.name.removeprefix("deepspeed_stage_")),
        accumulating=accumulating,
        cpu=replayed.device_type == "cpu",
    )
    timeline = replayed.window_first_timeline if accumulating else replayed.timeline
    if timeline is not None and settings.overlap_comm:
        # the CPU's live count does not see the fp32 master partition (allocated before the step, held by no tensor
        # it registers); CUDA's allocator counts it
        unseen = master if replayed.device_type == "cpu" else 0
        ranks = range(world) if rank is None else (rank,)
        highest = max((buckets_held.peak(timeline, r) for r in ranks), key=lambda peak: peak or 0)
        if highest is not None:
            backward_other = parameters + state - unseen + highest - sum(backward_parts)
    # the step's peak: the gradient partition, one partition-sized temporary of the optimizer's and the batch (fitted
    # on gloo with Adam). On the CPU the live count's own, the larger of two moments that miss the master partition
    # until an op writes it: DeepSpeed flattening the partition's gradients (a partition-sized copy beside them,
    # those crossing its edges too) and the optimizer's step over the flat partition (its temporaries, the master
    # from its first write: AdamW's first op, Adam's and SGD's last)
    optimizer_other = 2 * partition - gradients
    stepping = cpu_step_bytes(optimizer, max(shares)) if replayed.device_type == "cpu" else None
    if stepping is not None:
        optimizer_other = max(partition + stepping - master - gradients, partition - master)
    # forward: the counted parts, or with the step's temporaries (a convolution's, the loss's) the live count beside
    # them, which on the CPU misses the master partition
    forward_other = max(other_bytes(replayed, Phase.FORWARD) - (master if replayed.device_type == "cpu" else 0), 0)
    phases = {
        Phase.FORWARD: ((parameters, held, state, forward_activations), forward_other),
        Phase.BACKWARD: (backward_parts, backward_other),
        Phase.OPTIMIZER: (
            (parameters, gradients, state, 0),
            optimizer_other + batch_bytes(predictor.batch),
        ),
    }
    lines = (
        RankLine("ZeRO fp32 master partition", master, f"1/{world} of the flat fp32 copy (padded to 2N elements)"),
        RankLine(
            f"ZeRO reduce buckets ({buckets})",
            buckets * bucket,
            f"reduce_bucket_size {settings.reduce_bucket_size} elements each, overlap_comm={settings.overlap_comm}",
        ),
        RankLine(
            "ZeRO all-gather bucket",
            min(settings.allgather_bucket_size, parameters // element) * element,
            f"allgather_bucket_size {settings.allgather_bucket_size} elements, at most the parameters",
        ),
    )
    # one all-gather a step; ZeRO-2 reduce-scatters every micro-batch, ZeRO-1 once a window
    reduces = predictor.accumulate if spec.name == "deepspeed_stage_2" else 1
    return phases, lines, shard_communication(parameters, world, 1) + (reduces - 1) * (world - 1) * parameters // world


WINDOW_HELD = {"deepspeed_stage_1": 1}
"""Copies of every parameter's whole gradient a ZeRO stage holds between an accumulation window's micro-batches
(measured on gloo with ``gradient_accumulation_steps=2``: ZeRO-1 keeps ``param.grad`` whole; ZeRO-2 and 3 reduce
each micro-batch into their partitions)."""


def _stage3(
    predictor: Predictor, replayed: ReplayedStep, spec: StrategySpec, settings: ZeroSettings, element: int
) -> tuple[Phases, tuple[RankLine, ...], int]:
    world = spec.world_size
    optimizer = step_optimizer(predictor)
    numels = [n for group in group_numels(predictor) for n in group]
    share = sum(math.ceil(n / world) for n in numels)
    parameters = gradients = share * element
    state = share * FP32 + flat_state_bytes(optimizer, share)
    bucket = settings.reduce_bucket_size * element
    gathered = gathered_direct_bytes(predictor.module, element)
    forward = replayed.phases[Phase.FORWARD].breakdown.activations + gathered  # type: ignore[union-attr]
    backward = backward_activations(replayed) + gathered
    forward_parts = (parameters, gradients, state, forward)
    backward_parts = (parameters, gradients + bucket, state, backward)
    forward_other, backward_other = other_bytes(replayed, Phase.FORWARD), 0
    if predictor.accumulate == 1:
        # the parameters gathered whole and held from forward to their backward, one all-gather's buffer
        # (_zero3_peaks); the CPU's live count misses three of the partitions
        resident = parameters + gradients + state - unseen_partitions(replayed.device_type, share, element, FP32)
        held = sum(numels) * element - gathered
        # a module's own parameters are gathered at its fetch in one all-gather, whatever the prefetch bucket
        widest = max((fetched_numel(child) for child in predictor.module.modules()), default=0)
        buffer = max(min(settings.stage3_prefetch_bucket_size, sum(numels)), widest) * element
        forward_other = max(forward_live(predictor, replayed, resident, held, buffer, gathered) - sum(forward_parts), 0)
        last = last_module_bytes(predictor, replayed, element)
        wide = tuple(n * element for n in numels if n > settings.reduce_bucket_size)
        live = backward_live(replayed, resident, bucket, held, last, gathered, wide)
        if live is not None:
            peak, whole_gradient = live
            backward_parts = (parameters, gradients + bucket + whole_gradient, state, backward)
            backward_other = max(peak - sum(backward_parts), 0)
    # the step's peak beyond its parts: a partition-sized temporary, the reduce bucket and the batch (fitted on gloo
    # with Adam and SGD). On the CPU the optimizer's own temporaries over the partition beyond the fp32 master, which
    # the live count misses until the step writes it, where they are more: AdamW scales the master first, then makes
    # Adam's two temporaries (a transformer LM under AdamW: 2,433,444 B predicted, 2,825,360 measured, before)
    stepped = parameters
    stepping = cpu_step_bytes(optimizer, share) if replayed.device_type == "cpu" else None
    if stepping is not None:
        stepped = max(stepping - share * FP32, parameters)
    phases = {
        Phase.FORWARD: (forward_parts, forward_other),
        Phase.BACKWARD: (backward_parts, backward_other),
        Phase.OPTIMIZER: ((parameters, gradients, state, 0), stepped + bucket + batch_bytes(predictor.batch)),
    }
    whole = sum(numels) * element
    lines = (
        RankLine("ZeRO fp32 master partition", share * FP32, f"ceil(numel / {world}) of every parameter, in fp32"),
        RankLine("ZeRO gradient partition", gradients, "grad_partitions_flat_buffer, held the whole run"),
        RankLine(
            "ZeRO reduce bucket", bucket, f"reduce_bucket_size {settings.reduce_bucket_size} elements, in backward"
        ),
        RankLine(
            "ZeRO-3 prefetch bucket",
            min(settings.stage3_prefetch_bucket_size * element, whole),
            f"stage3_prefetch_bucket_size {settings.stage3_prefetch_bucket_size} elements, at most the parameters;"
            " a bound, not in the phases' peaks",
        ),
        RankLine(
            "ZeRO-3 live parameters (bound)",
            min(settings.stage3_max_live_parameters * element, whole),
            f"stage3_max_live_parameters {settings.stage3_max_live_parameters} elements, at most the parameters;"
            " a bound, not in the phases' peaks",
        ),
    )
    return phases, lines, shard_communication(whole, world, 2) * predictor.accumulate  # all of it every micro-batch


FIRST_MICRO_BATCH = (
    "accumulation: the figures are the window's steady micro-batch (with the optimizer step); the strategy's"
    " arithmetic does not predict the window's first micro-batch (no window_first)"
)
"""The note of a sharded strategy's arithmetic under accumulation."""
OFFLOAD_BASIS = (
    "ZeRO-Offload (offload_optimizer to the CPU, as DeepSpeedStrategy(offload_optimizer=True) sets it): the fp32"
    " master partition, the optimizer's state and the gradient partition live in host memory and the step runs"
    " there; documented arithmetic, not checked against a run (the CPU runs cannot tell host from device)"
)
"""How an offloaded ZeRO rank's host and device figures are made."""


def offloaded(phases: Phases, lines: tuple[RankLine, ...], batch: int) -> tuple[Phases, tuple[RankLine, ...]]:
    """``phases`` with the optimizer's state and the gradient partition moved to the host, as their own lines.

    On the device stay the parameters (ZeRO-3: the partition), backward's reduce bucket, the activations and the
    step's temporaries; the optimizer step runs on the host, its device peak the parameters and the batch.
    """
    parameters, gradients, state, _ = phases[Phase.OPTIMIZER][0]
    (_, held, _, forward), forward_other = phases[Phase.FORWARD]
    (_, backward_gradients, _, backward), backward_other = phases[Phase.BACKWARD]
    device: Phases = {
        Phase.FORWARD: ((parameters, 0, 0, forward), forward_other),
        Phase.BACKWARD: ((parameters, backward_gradients - held, 0, backward), backward_other),  # the bucket
        Phase.OPTIMIZER: ((parameters, 0, 0, 0), batch),
    }
    host = (
        RankLine("ZeRO-Offload optimizer state and fp32 master (host)", state, OFFLOAD_BASIS, on_host=True),
        RankLine("ZeRO-Offload gradient partition (host)", gradients, OFFLOAD_BASIS, on_host=True),
    )
    return device, (*lines, *host)


def predict_zero(
    predictor: Predictor,
    spec: StrategySpec,
    change: StepChange | None,
    settings: ZeroSettings = LIGHTNING_DEFAULTS,
    rank: int | None = None,
) -> RankStep | ReplaySkipped:
    """Rank ``rank`` (``None``: the one holding the most) of ``spec``'s ZeRO stage, with ``settings``.

    ZeRO-1/2 without ``overlap_comm`` hold other gradients in backward (ZeRO-1 the whole ones,
    tests/test_distributed.py): not modelled, skipped saying so.
    """
    if not settings.overlap_comm and spec.name != "deepspeed_stage_3":
        return ReplaySkipped(f"{spec.label}: ZeRO-1/2 without overlap_comm is not modelled yet")
    replayed = predictor.replay(change)
    if isinstance(replayed, ReplaySkipped):
        return replayed
    precision = change.precision if isinstance(change, PrecisionChange) else predictor.precision
    element = element_bytes(precision)
    stage = int(spec.name.removeprefix("deepspeed_stage_"))
    if stage == 3:
        phases, lines, sent = _stage3(predictor, replayed, spec, settings, element)
    else:
        phases, lines, sent = _stage12(predictor, replayed, spec, settings, rank, element)
    method = f"{METHOD} (stage {stage})"
    transfer = 0
    if spec.offload:
        # each step the gradient partition goes to the host, the updated parameter partition comes back
        transfer = 2 * phases[Phase.OPTIMIZER][0][1]
        phases, lines = offloaded(phases, lines, batch_bytes(predictor.batch))
        method += f"; {OFFLOAD_BASIS}"
    step = replayed.phases[Phase.FORWARD].step
    peaks = {phase: phase_peak(step, phase, parts, sum(parts) + other) for phase, (parts, other) in phases.items()}
    notes = (*replayed.notes, *((FIRST_MICRO_BATCH,) if predictor.accumulate > 1 else ()))
    return RankStep(spec, peaks, lines, sent, method, notes, replayed, host_transfer_bytes=transfer)


def predict(predictor: Predictor, spec: StrategySpec, change: StepChange | None) -> RankStep | ReplaySkipped:
    """One rank of ``spec`` under Lightning's ``DeepSpeedStrategy`` defaults: the rank holding the most."""
    return predict_zero(predictor, spec, change)
