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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.measure.setup import checkpointing_switches
from lightning_vram.measure.tensors import batch_size_of
from lightning_vram.plan_inputs import PlanInputError, resolve_batch, resolve_gpus
from lightning_vram.predict import REPLAYED_PRECISIONS, _replay_device
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, DEFAULT_CUDA_CONTEXT_BYTES
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.batches import resize_batch
from lightning_vram.prediction.replay.reserved import run_settings
from lightning_vram.prediction.replay.serves import serve
from lightning_vram.records import CheckpointChange, ReplayedStep, ReplaySkipped
from lightning_vram.records.plan import Plan, PlanRow

SINGLE = "single"
"""The strategy of one GPU: no process group."""
MULTI_GPU_STRATEGIES = ("ddp", "fsdp2", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
"""The strategies a plan tries on more than one GPU by default (``fsdp``: FSDP1 with FULL_SHARD)."""
DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
"""How many GPUs a plan tries by default."""
MAX_WORLD_SIZE = 1024
"""The most GPUs a plan predicts for."""


@dataclass(frozen=True)
class _Configuration:
    """What a replay is made for: the precision, checkpointing on or off, and the micro-batch (samples per rank)."""

    precision: str
    checkpointing: bool
    micro_batch: int | None


@dataclass(frozen=True)
class _Fit:
    """A rank's step at one card: whether the allocator served it, the reserved peak, the failed request."""

    fits: bool
    reserved_bytes: int | None
    shortfall: str | None


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
        gpus: GPU names from :data:`~lightning_vram.prediction.devices.COMMON_GPUS` (a unique part is enough:
            ``"T4"``) or memory in bytes; ``None``: every common GPU.
        world_sizes: how many GPUs in all, each tried (``(1, 2, 4, 8)``: a node's common counts).
        nodes: nodes the GPUs are spread over (each world size a multiple of it).
        strategies: the multi-GPU strategies tried (of :data:`MULTI_GPU_STRATEGIES`); ``None``: all of them. One
            GPU is always ``"single"``.
        precisions: precisions as Lightning names them, each replayed.
        checkpointing: activation checkpointing off, on (the plan the advice would print: the module's own switch
            for a transformers model), or both.
        global_batch: samples per optimizer step over every rank; each rank takes its share, as large micro-batches
            as fit with the accumulation that keeps it. ``None``: each rank the batch's own size.
        cuda_context_bytes: what each card keeps outside the caching allocator (the CUDA context, libraries), bytes.
        budget_seconds: host seconds for the whole plan: configurations not reached are listed in ``left_out``.
        device_type: ``"cuda"`` (replayed on fake CUDA tensors where torch is a CUDA build, else on the CPU, noted).

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
    if not isinstance(module, nn.Module):
        raise PlanInputError(f"module must be a LightningModule, got {type(module).__name__}")
    batch, source = resolve_batch(module, batch, datamodule)
    device, notes = _replay_device(device_type)
    settings = run_settings() if device_type.startswith("cuda") else None
    if isinstance(settings, str):
        notes += (settings,)
    allocator = settings if isinstance(settings, AllocatorSettings) else None
    planner = _Planner(module, batch, device, allocator, chosen_gpus, cuda_context_bytes, started + budget_seconds)
    with round_of_replays():
        rows = planner.rows(sizes, nodes, chosen_strategies, chosen_precisions, modes, global_batch)
    ordered = sorted(rows, key=_rank_key)
    return Plan(
        tuple(ordered),
        source,
        global_batch,
        None if allocator is None else allocator.conf(),
        cuda_context_bytes,
        assumptions=planner.assumptions,
        left_out=tuple(dict.fromkeys(planner.left_out)),
        notes=tuple(dict.fromkeys((*notes, *planner.notes))),
        seconds=time.perf_counter() - started,
    )


def _rank_key(row: PlanRow) -> tuple[bool, float, int, int]:
    """Best first: fitting rows, then the highest throughput, then fewer GPUs, then the lower peak."""
    rate = row.samples_per_second if row.samples_per_second is not None else -1.0
    return (not row.fits, -rate, row.gpus, row.peak_bytes)


class _Planner:
    """The plan's replays, each made once and kept, and the rows they serve."""

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        device: torch.device,
        allocator: AllocatorSettings | None,
        gpus: tuple[tuple[str, int], ...],
        context_bytes: int,
        deadline: float,
    ) -> None:
        self.module = module
        self.batch = batch
        self.batch_size = batch_size_of(batch)
        self.device = device
        self.allocator = allocator
        self.gpus = gpus
        self.context_bytes = context_bytes
        self.deadline = deadline
        self.left_out: list[str] = []
        self.notes: list[str] = []
        self.assumptions: tuple[str, ...] = ()
        self._steps: dict[_Configuration, ReplayedStep | None] = {}
        self._predictors: dict[tuple[str, int | None], Predictor] = {}
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
        """Every configuration's row (its largest fitting micro-batch), as far as the budget reaches."""
        rows: list[PlanRow] = []
        for precision in precisions:
            for checkpointed in checkpointing:
                for size in world_sizes:
                    for strategy in (SINGLE,) if size == 1 else strategies:
                        rows += self._configuration_rows(precision, checkpointed, size, nodes, strategy, global_batch)
        return rows

    def _configuration_rows(
        self, precision: str, checkpointed: bool, size: int, nodes: int, strategy: str, global_batch: int | None
    ) -> list[PlanRow]:
        """A row per GPU for a precision, checkpointing, world size and strategy: its largest micro-batch that fits."""
        what = f"{size} x {strategy}, {precision}" + (", checkpointing" if checkpointed else "")
        per_rank = self._per_rank(global_batch, size)
        if isinstance(per_rank, str):
            self.left_out.append(f"{what}: {per_rank}")
            return []
        if strategy != SINGLE:
            self.left_out.append(f"{what}: per-rank replay of {strategy} not available in this build")
            return []
        found: dict[str, PlanRow] = {}
        last: dict[str, PlanRow] = {}
        for micro in _micro_batches(per_rank):
            step = self._step(_Configuration(precision, checkpointed, micro), what)
            if step is None:
                break
            accumulation = 1 if micro is None or per_rank is None else per_rank // micro
            for gpu, capacity in self.gpus:
                if gpu in found:
                    continue
                fit = self._fit(step, capacity)
                row = PlanRow(
                    gpu,
                    capacity,
                    size,
                    nodes,
                    strategy,
                    precision,
                    checkpointed,
                    micro,
                    accumulation,
                    step.peak.peak_bytes,
                    fit.reserved_bytes,
                    fit.fits,
                    fit.shortfall,
                    method="replayed",
                )
                (found if fit.fits else last)[gpu] = row
            if len(found) == len(self.gpus):
                break
        return [found.get(gpu) or last[gpu] for gpu, _ in self.gpus if gpu in found or gpu in last]

    def _per_rank(self, global_batch: int | None, size: int) -> int | str | None:
        """Samples each rank takes per optimizer step (``None``: no batch dimension), or why the size cannot split."""
        if global_batch is None:
            return self.batch_size
        if self.batch_size is None:
            return "the batch has no batch dimension to split a global batch over"
        if global_batch % size:
            return f"a global batch of {global_batch} does not split over {size} GPUs"
        return global_batch // size

    def _step(self, configuration: _Configuration, what: str) -> ReplayedStep | None:
        """The rank's step replayed for ``configuration`` (kept: replayed once); ``None`` where it failed."""
        if configuration in self._steps:
            return self._steps[configuration]
        step = self._replay(configuration, what)
        self._steps[configuration] = step
        return step

    def _replay(self, configuration: _Configuration, what: str) -> ReplayedStep | None:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            self.left_out.append(f"{what}, micro-batch {configuration.micro_batch}: the time budget ran out")
            return None
        predictor = self._predictor(configuration.precision, configuration.micro_batch, left)
        change = None
        if configuration.checkpointing:
            checkpoint = self._checkpoint_change(configuration)
            if isinstance(checkpoint, str):
                self.left_out.append(f"{what}: {checkpoint}")
                return None
            change = checkpoint
        step = predictor.replay(change, count_flops=True)
        if isinstance(step, ReplaySkipped):
            self.left_out.append(f"{what}, micro-batch {configuration.micro_batch}: not replayed ({step.reason})")
            return None
        self.notes += step.notes
        return step

    def _predictor(self, precision: str, micro_batch: int | None, left: float) -> Predictor:
        """The predictor of a precision and micro-batch, its budget what is left of the plan's."""
        key = (precision, micro_batch)
        predictor = self._predictors.get(key)
        if predictor is None:  # its budget counts from now to the plan's deadline
            batch = self.batch
            if micro_batch is not None and self.batch_size is not None and micro_batch != self.batch_size:
                batch = resize_batch(batch, self.batch_size, micro_batch)
            predictor = Predictor(
                self.module,
                None,
                batch,
                precision=precision,
                placement=self.device,
                warm_up=True,
                budget_seconds=left,
                allocator=self.allocator,
            )
            self._predictors[key] = predictor
        return predictor

    def _checkpoint_change(self, configuration: _Configuration) -> CheckpointChange | str:
        """The checkpointing the advice would print, chosen on the step without it; or why there is none."""
        if self._checkpoint is None:
            plain = self._step(_Configuration(configuration.precision, False, configuration.micro_batch), "baseline")
            if plain is None:
                return "checkpointing: the step without it was not replayed"
            plans = checkpoint_candidates(plain.modules, checkpointing_switches(self.module), limit=1)
            self._checkpoint = (
                CheckpointChange(plans[0]) if plans else "checkpointing: no plan frees memory at the peak"
            )
        return self._checkpoint

    def _fit(self, step: ReplayedStep, capacity: int) -> _Fit:
        """Whether the step fits a card of ``capacity`` bytes: the simulated allocator serves it, the context kept."""
        if step.allocations is None or self.allocator is None:
            limit = capacity * (1 - BATCH_SAFETY_MARGIN) - self.context_bytes
            return _Fit(step.peak.peak_bytes <= limit, None, None)
        serving = serve(step.allocations, self.allocator, capacity - self.context_bytes)
        shortfall = serving.shortfall.text if serving.shortfall is not None else None
        return _Fit(serving.served, serving.reserved_peak_bytes, shortfall)


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
            raise PlanInputError(f"strategies must be of {', '.join(MULTI_GPU_STRATEGIES)}, got {strategy!r}")
    return tuple(dict.fromkeys(strategies))


def _check_precisions(precisions: Sequence[str]) -> tuple[str, ...]:
    """The precisions, each one a replay reproduces."""
    if isinstance(precisions, str) or not precisions:
        raise PlanInputError(f"precisions must be a non-empty list of precisions, got {precisions!r}")
    for precision in precisions:
        if precision not in REPLAYED_PRECISIONS:
            raise PlanInputError(f"precisions must be of {', '.join(REPLAYED_PRECISIONS)}, got {precision!r}")
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
