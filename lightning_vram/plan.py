"""Which GPUs to rent, how many, with which strategy and settings, and how fast a step runs: one process answers.

For a notebook or a shell (``lightning-vram plan``)::

    from lightning_vram.plan import plan

    result = plan(model, batch)                      # every common GPU, 1 to 8 of them, the strategies that apply
    print(result)                                    # the table, best first
    result.fits, result.best                         # whether one fits; the first row
    plan(model, batch, gpus=["A100 80GB"], world_sizes=(8,), global_batch=512)

Each configuration is a GPU x count x strategy x precision x checkpointing x micro-batch x accumulation. Its rank's
step is replayed under fake tensors (:mod:`lightning_vram.prediction.replay`) once per precision, checkpointing and
micro-batch, and that replay serves every GPU whose fit derives from it: a GPU only changes the capacity the
simulated caching allocator serves the step at (:func:`~lightning_vram.prediction.replay.serves.serve`, the card's
memory less the CUDA context, with the environment's ``PYTORCH_ALLOC_CONF``: what ``predict()``'s fit table calls
fitting). For each configuration the largest micro-batch that fits is kept, with the accumulation that keeps the
rank's share of the global batch. Rows are ordered: those that fit first, then by throughput.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.measure.setup import checkpointing_switches
from lightning_vram.measure.tensors import batch_size_of
from lightning_vram.plan_inputs import PlanGpu, PlanInputError, resolve_batch, resolve_gpus
from lightning_vram.plan_syntax import check_split
from lightning_vram.predict import REPLAYED_PRECISIONS, _replay_device
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, DEFAULT_CUDA_CONTEXT_BYTES
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.batches import resize_batch
from lightning_vram.prediction.replay.cuda_kernels import merged_kernel_notes
from lightning_vram.prediction.replay.reserved import run_settings
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.prediction.replay.twin import module_device
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.prediction.strategies.fsdp1 import predict_window as fsdp1_window
from lightning_vram.prediction.strategies.fsdp2 import shard_units, usual_policy_code
from lightning_vram.prediction.strategies.stronger import small_parameter_bytes
from lightning_vram.prediction.timing import LINKS, Link, predict_step_time
from lightning_vram.prediction.timing.peaks import GPU_ACHIEVED
from lightning_vram.records import (
    CheckpointChange,
    RankStep,
    ReplayedStep,
    ReplaySkipped,
    StepChange,
    StrategySpec,
    in_phase_order,
)
from lightning_vram.records.plan import Plan, PlanRow
from lightning_vram.records.simulation import PERSISTENCE_THRESHOLD

META_NOTE = (
    "replayed on the meta device, where the module's parameters are (no memory of the model's size was allocated):"
    " parts and peaks are the meta kernels' (for CUDA, dropout's and attention's are CUDA's; other CUDA kernels may"
    " save other tensors)"
)
"""The note of a plan for a module on the meta device (built under ``torch.device("meta")``)."""
META_AUTOCAST = (
    "torch's autocast has no meta device: mixed precision is not replayed for a module on it (true precisions are:"
    " bf16-true, 16-true, 32-true)"
)
"""Why a plan for a module on the meta device leaves the mixed precisions out."""
SINGLE = "single"
"""The strategy of one GPU: no process group."""
MULTI_GPU_STRATEGIES = ("ddp", "fsdp2", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3")
"""The strategies a plan tries on more than one GPU by default (``fsdp``: FSDP1 with FULL_SHARD). ZeRO-1 is not
ZeRO-2 with more memory: under accumulation it reduces once a window where ZeRO-2 reduces every micro-batch."""
DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
"""How many GPUs a plan tries by default."""
MAX_WORLD_SIZE = 1024
"""The most GPUs a plan predicts for."""


@dataclass(frozen=True)
class _Configuration:
    """What a rank's step is predicted for: precision, checkpointing, micro-batch (samples) and accumulation.

    ``accumulation``: micro-batches per optimizer step, for FSDP1's rows (1 for the others): they hold a window's
    gradients in backward (Lightning accumulates without ``no_sync``).
    """

    precision: str
    checkpointing: bool
    micro_batch: int | None
    accumulation: int = 1


@dataclass(frozen=True)
class _Fit:
    """A rank's step at one card: whether the allocator served it, the reserved peak, the failed request."""

    fits: bool
    reserved_bytes: int | None
    shortfall: str | None


class _PlanPredictor(Predictor):
    """A predictor that counts every op (the step time is predicted from them) and the replays it runs.

    With a ``store``, its replays are kept: a strategy asking again for the same step gets the same replay. Kept by
    the change and every attribute a replay reads; given only for the strategies of :data:`SHARED_REPLAYS`, whose
    rank is the single-process replay with arithmetic (DDP's buckets too): one replay per precision, checkpointing
    and micro-batch serves all of them at every world size.
    """

    store: dict[tuple[object, ...], ReplayedStep | ReplaySkipped] | None = None
    ran: list[int]
    """One count, shared by the plan's predictors: the replays run."""

    def replay(self, change: StepChange | None = None, count_flops: bool = True) -> ReplayedStep | ReplaySkipped:
        """The replay of ``change`` with its ops counted, made once for these settings where replays are kept."""
        key = (repr(change), self.strategy, self.step_function, self.precision, self.shape, self.placement)
        if self.store is not None and key in self.store:
            return self.store[key]
        self.ran[0] += 1
        replayed = super().replay(change, count_flops=True)
        if self.store is not None:
            self.store[key] = replayed
        return replayed


SHARED_REPLAYS = ("single", "ddp", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3")
"""Strategies whose rank is the single-process replay with the strategy's arithmetic: its replay at one world size
serves every world size (:class:`_PlanPredictor`)."""


def plan(
    module: nn.Module,
    batch: Any = None,
    *,
    datamodule: Any = None,
    gpus: Sequence[str | int] | None = None,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    nodes: int = 1,
    strategies: Sequence[str] | None = None,
    precisions: Sequence[str] = ("32-true", "bf16-mixed"),
    checkpointing: Sequence[bool] = (False, True),
    global_batch: int | None = None,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES,
    budget_seconds: float = 45.0,
    device_type: str = "cuda",
) -> Plan:
    """Predict every configuration's per-rank memory, whether it fits, and its step time; best first.

    Nothing is trained and the module is left as it was.

    Args:
        module: a LightningModule (its ``training_step`` and ``configure_optimizers`` are replayed).
        batch: one batch as ``training_step`` receives it (only shapes and dtypes matter); ``None``: the module's
            ``example_input_array``, else the first training batch of ``datamodule`` or of the module's own
            ``train_dataloader`` (the plan says which).
        datamodule: a LightningDataModule whose first training batch is planned for when ``batch`` is ``None``.
        gpus: GPU names (a card of :data:`~lightning_vram.prediction.timing.GPU_PEAKS`: ``"H100"``, ``"T4"``, or a
            row of :data:`~lightning_vram.prediction.devices.COMMON_GPUS`) or memory in bytes; ``None``: every card.
        world_sizes: how many GPUs in all, each tried (``(1, 2, 4, 8)``: a node's common counts).
        nodes: nodes the GPUs are spread over (each world size a multiple of it).
        strategies: the multi-GPU strategies tried (of :data:`MULTI_GPU_STRATEGIES`); ``None``: all of them. One
            GPU is always ``"single"``.
        precisions: precisions as Lightning names them, each replayed.
        checkpointing: activation checkpointing off, on (the plan the advice would print: the module's own switch
            for a transformers model), or both.
        global_batch: samples per optimizer step over every rank; each rank takes its share, as large micro-batches
            as fit with the accumulation that keeps it (a world size it does not split over is left out; a multiple
            of one of them, and a batch with a batch dimension, are required). ``None``: each rank the batch's own
            size.
        cuda_context_bytes: what each card keeps outside the caching allocator (the CUDA context, libraries), bytes.
        budget_seconds: host seconds for the whole plan: configurations not reached are listed in ``left_out``.
        device_type: ``"cuda"`` (replayed on fake CUDA tensors where torch is a CUDA build, else on the CPU, noted).
            A module on the meta device (built under ``torch.device("meta")``: a large model without its memory) is
            replayed on the meta device, the batch moved there.

    Returns:
        The :class:`~lightning_vram.records.plan.Plan`, whose rows are best first.
    """
    started = time.perf_counter()
    chosen_gpus = resolve_gpus(gpus)
    sizes = _check_world_sizes(world_sizes, nodes)
    chosen_strategies = _check_strategies(strategies)
    chosen_precisions = _check_precisions(precisions)
    modes = _check_checkpointing(checkpointing)
    _check_numbers(global_batch, cuda_context_bytes, budget_seconds)
    check_split(global_batch, sizes)
    if not isinstance(module, nn.Module):
        raise PlanInputError(f"module must be a LightningModule, got {type(module).__name__}")
    batch, source = resolve_batch(module, batch, datamodule)
    if global_batch is not None and batch_size_of(batch) is None:
        raise PlanInputError(
            f"global_batch must be None (unset) for a batch with no batch dimension to split, got {global_batch}"
        )
    device, notes = _replay_device(device_type)
    if module_device(module).type == "meta":
        device, notes = torch.device("meta"), (META_NOTE,)
    settings = run_settings() if device_type.startswith("cuda") else None
    if isinstance(settings, str):
        notes += (settings,)
    allocator = settings if isinstance(settings, AllocatorSettings) else None
    planner = _Planner(
        module,
        batch,
        device,
        allocator,
        chosen_gpus,
        cuda_context_bytes,
        started + budget_seconds,
        for_cuda=device_type.startswith("cuda"),
    )
    with round_of_replays():
        rows = planner.rows(sizes, nodes, chosen_strategies, chosen_precisions, modes, global_batch)
    if any(row.strategy == "deepspeed_stage_3" for row in rows):
        small = small_parameter_bytes(module, 1)
        if small:
            notes += (zero3_persistence_note(small),)
    code = usual_policy_code(module) if any(row.strategy == "fsdp2" for row in rows) else None
    if code is not None:
        notes += (fsdp2_units_note(module, code),)
    if getattr(module, "automatic_optimization", True) is False and any(row.strategy == "ddp" for row in rows):
        notes += (MANUAL_DDP_NOTE,)
    return Plan(
        tuple(sorted(rows, key=_rank_key)),
        source,
        global_batch,
        None if allocator is None else allocator.conf(),
        cuda_context_bytes,
        assumptions=_assumptions(nodes),
        left_out=planner.left_out_lines(),
        notes=merged_kernel_notes((*notes, *planner.notes)),
        seconds=time.perf_counter() - started,
        replays=planner.ran[0],
    )


MANUAL_DDP_NOTE = (
    "ddp rows under manual optimization: where a backward leaves parameters without a gradient (a GAN's"
    " discriminator step on the generator's detached output), DDP raises at the next step unless"
    ' Trainer(strategy="ddp_find_unused_parameters_true"), under which the rows hold (a GAN on 2 gloo ranks: each'
    " phase within 0.001%)"
)
"""The note of a plan with ddp rows for a module under manual optimization: the plain ``"ddp"`` the rows name
raised on a GAN applied as printed ("parameters that were not used in producing the loss")."""


def fsdp2_units_note(module: nn.Module, code: str) -> str:
    """The note of a plan with fsdp2 rows for a module that does not shard itself: the code that shards it as they do.

    Without it the rows' units were nowhere printed (a model without an ``nn.ModuleList`` of blocks was predicted as
    one unit, every parameter gathered for the whole step, where a user sharding its blocks holds less).
    """
    units = len(shard_units(module)) - 1
    sharded = f"each of {units} blocks, then the root" if units else "the root alone (no blocks found)"
    root = (
        "; the root is the module itself: its training_step must call self(...), its forward, for FSDP2 to gather"
        " the parameters outside the blocks (Lightning runs training_step, not forward)"
        if code.endswith("fully_shard(self, mesh=mesh)")
        else ""
    )
    return (
        f"fsdp2 rows shard {sharded} (torch's fully_shard under Lightning's ModelParallelStrategy). To train as"
        f" predicted, in your LightningModule: {code}{root}"
    )


def zero3_persistence_note(small_elements: int) -> str:
    """The note of a plan with ZeRO-3 rows: the rows partition every parameter, Lightning's default does not.

    ``small_elements``: the elements of the parameters DeepSpeed's default ``stage3_param_persistence_threshold``
    keeps whole on every rank.
    Applied as ``Trainer(strategy="deepspeed_stage_3")`` on 2 gloo ranks, a transformer LM whose parameters are
    nearly all of at most 100,000 elements held 2,107,760 B of parameters per rank where its row said 1,043,920.
    """
    return (
        "zero3 rows partition every parameter (stage3_param_persistence_threshold 0); Lightning's"
        f" deepspeed_stage_3 keeps parameters of at most {PERSISTENCE_THRESHOLD:,} elements ({small_elements:,}"
        " elements here) whole on every rank. To train as predicted: strategy = DeepSpeedStrategy(stage=3);"
        ' strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0; Trainer(strategy=strategy)'
    )


def _assumptions(nodes: int) -> tuple[str, ...]:
    """What the step time assumes, in lines of at most 100 characters."""
    network = f"; {NETWORK} between nodes" if nodes > 1 else ""
    return (
        f"step: roofline per op at {GPU_ACHIEVED:.0%} of the card's published peaks; accumulation repeats the step",
        f"communication not overlapped: NVLink for SXM cards, PCIe otherwise{network}",
    )


TIE_STEP = 1.01
"""Throughputs per GPU within 1% of each other rank as equal: the step time is a roofline estimate, and a strategy
that holds several times the memory for 0.1% more samples per second is no better choice."""


def _rank_key(row: PlanRow) -> tuple[bool, float, int, int]:
    """Best first: fitting rows, the most samples per second per GPU, fewer GPUs, the lower peak.

    Samples per second per GPU rented, in 1% steps (:data:`TIE_STEP`). Per GPU, not in all: eight cards train about
    eight times the samples of one, and a renter pays for each; the table's ``samples/s`` column is the whole run's.
    """
    if row.samples_per_second is None or row.samples_per_second <= 0:
        step = -math.inf
    else:
        step = math.floor(math.log(row.samples_per_second / row.gpus) / math.log(TIE_STEP))
    return (not row.fits, -step, row.gpus, row.peak_bytes)


def _link(gpu: PlanGpu, nodes: int) -> Link:
    """The link a rank's traffic crosses: the network between nodes, else NVLink for SXM cards, else PCIe."""
    if nodes > 1:
        return LINKS[NETWORK]
    return LINKS[CARD_LINKS.get(gpu.name, "PCIe 4.0 x16")]


NETWORK = "200 Gb/s network"
"""The network assumed between nodes (HDR InfiniBand)."""
CARD_LINKS = {
    "A100 40GB SXM": "NVLink 3",
    "A100 80GB SXM": "NVLink 3",
    "H100 SXM": "NVLink 4",
    "H200 SXM": "NVLink 4",
    "H100 PCIe": "PCIe 5.0 x16",
}
"""The link between the GPUs of a node, by card (others: PCIe 4.0 x16)."""


NO_BF16 = "has no bf16 tensor cores (bf16 runs at its fp32 rate; plan it in 16-mixed)"
"""Why a card without bf16 tensor cores (the T4) gets no bf16 rows."""


def _computes(gpu: PlanGpu, precision: str) -> bool:
    """Whether ``gpu`` is planned in ``precision``: bf16 only on a card with bf16 tensor cores (or none known)."""
    return not precision.startswith("bf16") or gpu.peaks is None or gpu.peaks.bf16_tensor_cores


class _Search:
    """One configuration's search for the largest micro-batch each GPU fits, one micro-batch at a time."""

    def __init__(
        self,
        precision: str,
        checkpointing: bool,
        spec: StrategySpec,
        what: str,
        per_rank: int | None,
        gpus: tuple[PlanGpu, ...],
    ):
        self.precision = precision
        self.checkpointing = checkpointing
        self.spec = spec
        self.what = what
        """The configuration in words, for what the plan left out."""
        self.per_rank = per_rank
        self.gpus = gpus
        """The GPUs this configuration is planned on: those that compute its precision."""
        self.micro_batches = _micro_batches(per_rank)
        self.tried = 0
        """How many of :attr:`micro_batches` were predicted."""
        self.failed = False
        self.found: dict[PlanGpu, PlanRow] = {}
        """Each GPU's row at the largest micro-batch that fits it."""
        self.last: dict[PlanGpu, PlanRow] = {}
        """Each GPU's row at the smallest micro-batch tried, where none fitted."""

    def goes_on(self) -> bool:
        """Whether a smaller micro-batch is still to try: a GPU not fitted yet, and no prediction failed."""
        return not self.failed and len(self.found) < len(self.gpus) and self.tried < len(self.micro_batches)

    def rows(self) -> list[PlanRow]:
        """A row per GPU: its fitting one, else its last."""
        return [self.found.get(gpu) or self.last[gpu] for gpu in self.gpus if gpu in self.found or gpu in self.last]


class _Planner:
    """The plan's rank predictions, each made once and kept, and the rows they serve."""

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        device: torch.device,
        allocator: AllocatorSettings | None,
        gpus: tuple[PlanGpu, ...],
        context_bytes: int,
        deadline: float,
        for_cuda: bool = False,
    ) -> None:
        self.module = module
        self.batch = batch
        self.batch_size = batch_size_of(batch)
        self.device = device
        self.for_cuda = for_cuda
        """Whether the plan is for CUDA devices: its replays run CUDA's dropout and attention kernels."""
        self.allocator = allocator
        self.gpus = gpus
        self.context_bytes = context_bytes
        self.deadline = deadline
        self.left_out: dict[str, list[str]] = {}
        """Why configurations were left out, each reason with the configurations it left out."""
        self.unreplayed: set[str] = set()
        """The reasons of :attr:`left_out` a rank's prediction gave (its replay skipped or failed), not the plan's."""
        self.notes: list[str] = []
        self.ran = [0]
        """The replays run, one count shared by the plan's predictors."""
        self._ranks: dict[tuple[_Configuration, StrategySpec], RankStep | None] = {}
        self._predictors: dict[tuple[str, int | None], Predictor] = {}
        self._unbounded: dict[int, int] = {}
        """Each kept replay's reserved peak with no memory limit, by the replay's id (replays are kept: ids hold)."""
        self._checkpoint: CheckpointChange | str | None = None  # the change, or why there is none; None: not yet

    def rows(
        self,
        world_sizes: Sequence[int],
        nodes: int,
        strategies: Sequence[str],
        precisions: Sequence[str],
        checkpointing: Sequence[bool],
        global_batch: int | None,
    ) -> list[PlanRow]:
        """Every configuration's rows (one per GPU, its largest fitting micro-batch), as far as the budget reaches.

        Breadth first: every configuration at its largest micro-batch (checkpointing off before on), then the next
        smaller micro-batch for those a GPU did not fit yet, and so on; so a budget that runs out leaves out the
        smallest micro-batches, not whole precisions.
        """
        searches: list[_Search] = []
        for precision in precisions:
            for gpu in self.gpus:
                if not _computes(gpu, precision):
                    self._leave_out(f"{gpu.name} {NO_BF16}", precision)
        for checkpointed in checkpointing:
            for precision in precisions:
                gpus = tuple(gpu for gpu in self.gpus if _computes(gpu, precision))
                for size in world_sizes if gpus else ():
                    for strategy in (SINGLE,) if size == 1 else strategies:
                        spec = StrategySpec(strategy, size, gpus_per_node=None if nodes == 1 else size // nodes)
                        what = f"{spec.label}, {precision}" + (", checkpointing" if checkpointed else "")
                        per_rank = self._per_rank(global_batch, size)
                        if isinstance(per_rank, str):
                            self._leave_out(per_rank, what)
                        else:
                            searches.append(_Search(precision, checkpointed, spec, what, per_rank, gpus))
        # The configurations one replay serves first, then FSDP2's (a replay of its own for each world size): a
        # budget that runs out leaves out FSDP2's rows before any that cost no replay of their own.
        pending = searches = sorted(searches, key=lambda search: search.spec.name not in SHARED_REPLAYS)
        while pending:
            for search in pending:
                self._next_micro_batch(search, nodes)
            pending = [search for search in pending if search.goes_on()]
        return [row for search in searches for row in search.rows()]

    def _next_micro_batch(self, search: _Search, nodes: int) -> None:
        """Predict ``search``'s next micro-batch and keep each GPU's row (a fitting one once found)."""
        micro = search.micro_batches[search.tried]
        search.tried += 1
        accumulation = 1 if micro is None or search.per_rank is None else search.per_rank // micro
        window = accumulation if search.spec.name == "fsdp" else 1  # the other strategies' figures do not depend on it
        configuration = _Configuration(search.precision, search.checkpointing, micro, window)
        rank = self._rank(configuration, search.spec, search.what)
        if rank is None:
            search.failed = True
            return
        for gpu in search.gpus:
            if gpu not in search.found:
                row = self._row(rank, gpu, nodes, search.precision, search.checkpointing, micro, accumulation)
                (search.found if row.fits else search.last)[gpu] = row

    def _row(
        self,
        rank: RankStep,
        gpu: PlanGpu,
        nodes: int,
        precision: str,
        checkpointed: bool,
        micro: int | None,
        accumulation: int,
    ) -> PlanRow:
        """The row of one rank's step on one card."""
        fit = self._fit(rank, gpu.capacity_bytes)
        seconds = self._seconds(rank, gpu, nodes, accumulation)
        spec = rank.spec
        samples = None if micro is None else micro * accumulation * spec.world_size
        rate = samples / seconds if samples is not None and seconds is not None and seconds > 0 else None
        return PlanRow(
            gpu.name,
            gpu.capacity_bytes,
            spec.world_size,
            nodes,
            spec.name,
            precision,
            checkpointed,
            micro,
            accumulation,
            rank.peak.peak_bytes,
            fit.reserved_bytes,
            fit.fits,
            fit.shortfall,
            seconds,
            rate,
            rank.method,
            tuple((phase.value, peak.peak_bytes) for phase, peak in in_phase_order(rank.phases)),
            _parts(rank),
        )

    def _seconds(self, rank: RankStep, gpu: PlanGpu, nodes: int, accumulation: int) -> float | None:
        """The optimizer step's seconds on ``gpu``: each micro-batch's step, then the strategy's communication once."""
        step = rank.replayed
        if gpu.peaks is None or step is None or step.work is None:
            return None
        link = _link(gpu, nodes) if rank.communication_bytes else None
        time_ = predict_step_time(step, gpu.peaks, rank.communication_bytes, link)
        return accumulation * (time_.seconds - time_.communication_seconds) + time_.communication_seconds

    def _leave_out(self, reason: str, what: str) -> None:
        """Note a configuration left out, and why."""
        self.left_out.setdefault(reason, []).append(what)

    def left_out_lines(self) -> tuple[str, ...]:
        """Each reason configurations were left out for, with how many and the first of them; the replay's first.

        Where none was predicted, the plan's first line gives the first: a step that cannot be replayed is why
        nothing was, whatever the plan itself left out before trying (a card without bf16, a global batch that does
        not split). Then most configurations first; ties keep the order they came in.
        """
        reasons = sorted(self.left_out.items(), key=lambda item: (item[0] not in self.unreplayed, -len(item[1])))
        return tuple(
            f"{reason}: {whats[0]}" if len(whats) == 1 else f"{reason}: {len(whats)} configurations ({whats[0]}, ...)"
            for reason, whats in reasons
        )

    def _per_rank(self, global_batch: int | None, size: int) -> int | str | None:
        """Samples each rank takes per optimizer step (``None``: no batch dimension), or why the size cannot split."""
        if global_batch is None:
            return self.batch_size
        if global_batch % size:
            return f"a global batch of {global_batch} does not split over {size} GPUs"
        return global_batch // size

    def _rank(self, configuration: _Configuration, spec: StrategySpec, what: str) -> RankStep | None:
        """The rank's step under ``spec`` for ``configuration`` (kept: predicted once); ``None`` where it failed."""
        key = (configuration, spec)
        if key not in self._ranks:
            self._ranks[key] = self._predict_rank(configuration, spec, what)
        return self._ranks[key]

    def _predict_rank(self, configuration: _Configuration, spec: StrategySpec, what: str) -> RankStep | None:
        micro = f", micro-batch {configuration.micro_batch}" if configuration.micro_batch is not None else ""
        left = self.deadline - time.perf_counter()
        kept = (configuration.precision, configuration.micro_batch) in self._predictors
        shared = spec.name in SHARED_REPLAYS and kept
        if left <= 0 and not shared:  # a shared predictor's kept replay costs nothing; one it lacks stops at once
            self._leave_out("the time budget ran out", what + micro)
            return None
        if self.device.type == "meta" and configuration.precision.endswith("-mixed"):
            self._leave_out(META_AUTOCAST, what)
            return None
        change = None
        if configuration.checkpointing:
            checkpoint = self._checkpoint_change(configuration)
            if isinstance(checkpoint, str):
                self._leave_out(checkpoint, what)
                return None
            change = checkpoint
        predictor = self._predictor(configuration.precision, configuration.micro_batch, left, spec.name)
        if spec.name == "fsdp" and configuration.accumulation > 1:
            rank = fsdp1_window(predictor, spec, change)
        else:
            rank = predict_rank(predictor, spec, change)
        if isinstance(rank, ReplaySkipped):
            self.unreplayed.add(rank.reason)
            self._leave_out(rank.reason, what + micro)
            return None
        self.notes += rank.notes
        return rank

    def _predictor(self, precision: str, micro_batch: int | None, left: float, strategy: str) -> Predictor:
        """The predictor of a precision and micro-batch; its budget counts from now to the plan's deadline.

        The strategies of :data:`SHARED_REPLAYS` share one whose replays are kept; the others get a fresh one.
        """
        shared = strategy in SHARED_REPLAYS
        key = (precision, micro_batch)
        if shared and key in self._predictors:
            return self._predictors[key]
        batch = self.batch
        if micro_batch is not None and self.batch_size is not None and micro_batch != self.batch_size:
            batch = resize_batch(batch, self.batch_size, micro_batch)
        predictor = _PlanPredictor(
            self.module,
            None,
            batch,
            precision=precision,
            placement=self.device,
            warm_up=True,
            budget_seconds=left,
            allocator=self.allocator,
            for_cuda=self.for_cuda,
        )
        predictor.ran = self.ran
        if shared:
            predictor.store = {}
            self._predictors[key] = predictor
        return predictor

    def _checkpoint_change(self, configuration: _Configuration) -> CheckpointChange | str:
        """The checkpointing the advice would print, chosen on the step without it; or why there is none."""
        if self._checkpoint is None:
            plain = self._rank(
                _Configuration(configuration.precision, False, configuration.micro_batch), StrategySpec(SINGLE), ""
            )
            if plain is None or plain.replayed is None:
                return "checkpointing: the step without it was not replayed"
            plans = checkpoint_candidates(plain.replayed.modules, checkpointing_switches(self.module), limit=1)
            self._checkpoint = CheckpointChange(plans[0]) if plans else "checkpointing: no plan frees memory"
        return self._checkpoint

    def _fit(self, rank: RankStep, capacity: int) -> _Fit:
        """Whether the rank's step fits a card of ``capacity`` bytes.

        The simulated allocator serves it beside the context and NCCL's buffers, which are outside the allocator.
        """
        outside = sum(line.beside_allocator_bytes for line in rank.lines)
        step = rank.replayed
        if step is None or step.allocations is None or self.allocator is None or rank.phases != step.phases:
            # No sequence of this rank's allocations to serve (a strategy's arithmetic changed the replay's peaks).
            if self.allocator is not None:
                self.notes.append(ARITHMETIC_FIT)
            limit = capacity * (1 - BATCH_SAFETY_MARGIN) - self.context_bytes - outside
            return _Fit(rank.peak.peak_bytes <= limit, None, None)
        available = capacity - self.context_bytes - outside
        unbounded = self._unbounded.get(id(step))
        if unbounded is None:
            unbounded = self._unbounded[id(step)] = serve(
                step.allocations, self.allocator, UNBOUNDED
            ).reserved_peak_bytes
        if unbounded <= available:  # never reserving more than the card holds, the allocator never had to free
            return _Fit(True, unbounded, None)
        serving = serve(step.allocations, self.allocator, available)
        shortfall = serving.shortfall.text if serving.shortfall is not None else None
        return _Fit(serving.served, serving.reserved_peak_bytes, shortfall)


ARITHMETIC_FIT = (
    "a rank predicted by a strategy's arithmetic on the replay (ZeRO, FSDP1) has no allocation sequence to serve:"
    " it fits where its peak leaves 10% of the card free beside the context; its reserved memory is not predicted"
)
"""The note of a plan with such a rank."""
UNBOUNDED = 1 << 62
"""A capacity no step reaches: the allocator model's reserved peak where nothing limits it."""


def _parts(rank: RankStep) -> tuple[tuple[str, int], ...]:
    """The counted parts of the rank's peak phase, bytes (``other``: the peak beyond them)."""
    breakdown = rank.peak.breakdown
    if breakdown is None:
        return ()
    parts = breakdown.to_dict()
    return tuple((name, value) for name, value in parts.items() if isinstance(value, int))


def _micro_batches(per_rank: int | None) -> Sequence[int | None]:
    """The micro-batches tried for a rank's share, largest first: halved while it divides, then 1.

    >>> _micro_batches(24), _micro_batches(5), _micro_batches(None)
    ([24, 12, 6, 3, 1], [5, 1], [None])
    """
    if per_rank is None:
        return [None]
    sizes = [per_rank]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    if sizes[-1] != 1:
        sizes.append(1)
    return sizes


def _check_world_sizes(world_sizes: Sequence[int], nodes: int) -> list[int]:
    """The world sizes, checked: ints from 1 to :data:`MAX_WORLD_SIZE`, each a multiple of ``nodes``."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_WORLD_SIZE:
        raise PlanInputError(f"nodes must be an int from 1 to {MAX_WORLD_SIZE}, got {nodes!r}")
    if isinstance(world_sizes, (int, str)) or not world_sizes:
        raise PlanInputError(f"world_sizes must be a non-empty list of GPU counts, got {world_sizes!r}")
    for size in world_sizes:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
            raise PlanInputError(f"world_sizes must hold ints from 1 to {MAX_WORLD_SIZE}, got {size!r}")
        if size % nodes:
            raise PlanInputError(f"world_sizes must be multiples of nodes ({nodes}), got {size}")
    return list(dict.fromkeys(world_sizes))


def _check_strategies(strategies: Sequence[str] | None) -> tuple[str, ...]:
    """The multi-GPU strategies, checked against :data:`MULTI_GPU_STRATEGIES`."""
    if strategies is None:
        return MULTI_GPU_STRATEGIES
    if isinstance(strategies, str) or not strategies:
        raise PlanInputError(f"strategies must be a non-empty list of strategy names, got {strategies!r}")
    for strategy in strategies:
        if strategy not in MULTI_GPU_STRATEGIES:
            raise PlanInputError(f"strategies must be one of {', '.join(MULTI_GPU_STRATEGIES)}, got {strategy!r}")
    return tuple(dict.fromkeys(strategies))


def _check_precisions(precisions: Sequence[str]) -> tuple[str, ...]:
    """The precisions, each one a replay reproduces."""
    if isinstance(precisions, str) or not precisions:
        raise PlanInputError(f"precisions must be a non-empty list of precisions, got {precisions!r}")
    for precision in precisions:
        if precision not in REPLAYED_PRECISIONS:
            raise PlanInputError(f"precisions must be one of {', '.join(REPLAYED_PRECISIONS)}, got {precision!r}")
    return tuple(dict.fromkeys(precisions))


def _check_checkpointing(checkpointing: Sequence[bool]) -> tuple[bool, ...]:
    """Checkpointing off, on, or both."""
    if (
        not isinstance(checkpointing, (list, tuple))
        or not checkpointing
        or any(not isinstance(c, bool) for c in checkpointing)
    ):
        raise PlanInputError(f"checkpointing must be a non-empty list of True/False, got {checkpointing!r}")
    return tuple(dict.fromkeys(checkpointing))


def _check_numbers(global_batch: object, cuda_context_bytes: object, budget_seconds: object) -> None:
    """The global batch, the context and the budget, checked."""
    if global_batch is not None and (
        isinstance(global_batch, bool) or not isinstance(global_batch, int) or not 1 <= global_batch <= 10**9
    ):
        raise PlanInputError(f"global_batch must be None or an int from 1 to 10**9, got {global_batch!r}")
    if isinstance(cuda_context_bytes, bool) or not isinstance(cuda_context_bytes, int) or cuda_context_bytes < 0:
        raise PlanInputError(f"cuda_context_bytes must be an int >= 0, got {cuda_context_bytes!r}")
    if isinstance(budget_seconds, bool) or not isinstance(budget_seconds, (int, float)):
        raise PlanInputError(f"budget_seconds must be a number of seconds > 0, got {budget_seconds!r}")
    if not 0 < budget_seconds < 86_400:
        raise PlanInputError(f"budget_seconds must be > 0 and under a day, got {budget_seconds!r}")
