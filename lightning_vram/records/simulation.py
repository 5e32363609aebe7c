"""What a replay of the step tells: the changes it tries, the replayed step, and what is built on it.

That is its match with the measured step, the simulation of a run, the prediction without training and the preflight
verdict. All sizes are integer bytes, all times seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lightning_vram.records.advice import Advice, CheckpointPlan, FitRow, ReportText, SavingBasis
from lightning_vram.records.measured import ModuleProfile, Phase, PhasePeak
from lightning_vram.records.timeline import StepTimeline
from lightning_vram.records.work import StepWork

NOT_REPLAYED = "not replayed"
"""How :attr:`VariantResult.discarded` starts for a change the time budget never reached, or cut: untried, not
failed (the rules read it)."""


AllocationEvent = tuple[str, int, int, int] | Phase
"""One step of a replay's allocation sequence: ``("malloc", block, size, stream)`` (size in bytes as requested),
``("free", block, 0, 0)``, or the start of a phase."""

AllocationSequence = tuple[AllocationEvent, ...]
"""A replayed step's allocations and frees on the counted device, in the order a steady step makes them (library
workspaces, negative blocks, alive from the step's start): what a caching allocator's model is driven with."""


class ChangeKind(ReportText):
    """What a replayed change alters, as the report's ``variants[].kind`` names it."""

    PRECISION = "precision"
    CHECKPOINT = "checkpoint"
    INPLACE = "inplace"
    FREE_GRADIENTS = "free-gradients"
    BATCH_SIZE = "batch-size"
    LENGTH = "length"
    TOKENS_PER_BATCH = "tokens-per-batch"


@dataclass(frozen=True)
class PrecisionChange:
    """Replay the step in another precision, named as Lightning names it (``"bf16-mixed"``, ``"bf16-true"``...)."""

    kind: ClassVar[ChangeKind] = ChangeKind.PRECISION

    precision: str

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f'precision="{self.precision}"'


@dataclass(frozen=True)
class CheckpointChange:
    """Replay the step with ``plan``'s units wrapped in non-reentrant activation checkpointing."""

    kind: ClassVar[ChangeKind] = ChangeKind.CHECKPOINT

    plan: CheckpointPlan

    @property
    def label(self) -> str:
        """How the report names the change."""
        plan = self.plan
        where = plan.container or "the model"
        if plan.switch is not None:
            owner = f"{plan.container}." if plan.container else "the model's "
            return f"{owner}{plan.switch}() ({len(plan.units)} layers)"
        if plan.sequential_segments is not None:
            return f"checkpoint {where} in {plan.sequential_segments} segments"
        return f"checkpoint {plan.span_text()}"


@dataclass(frozen=True)
class InplaceChange:
    """Replay the step with ``inplace=True`` set on the named activation modules."""

    kind: ClassVar[ChangeKind] = ChangeKind.INPLACE

    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f"inplace activations in {len(self.modules)} module(s)"


@dataclass(frozen=True)
class FreeGradientsChange:
    """Replay the step with the previous step's gradients set to ``None`` before the forward pass."""

    kind: ClassVar[ChangeKind] = ChangeKind.FREE_GRADIENTS

    @property
    def label(self) -> str:
        """How the report names the change."""
        return "gradients set to None before forward"


@dataclass(frozen=True)
class BatchSizeChange:
    """Replay the step with every batch tensor's first dimension (the batch size) set to ``batch_size``."""

    kind: ClassVar[ChangeKind] = ChangeKind.BATCH_SIZE

    batch_size: int

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f"batch size {self.batch_size}"


@dataclass(frozen=True)
class LengthChange:
    """Replay the step with the batch cut (or stretched) to ``length`` along its length dimension (tokens)."""

    kind: ClassVar[ChangeKind] = ChangeKind.LENGTH

    length: int

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f"sequences capped at {self.length} tokens"


@dataclass(frozen=True)
class TokensPerBatchChange:
    """Replay the step with the batch holding at most ``tokens`` tokens: as many of its sequences as fit, at least one.

    A batch of ``B`` sequences ``L`` tokens long keeps ``max(1, min(B, tokens // L))`` of them (batching by tokens,
    so a long batch holds fewer sequences).
    """

    kind: ClassVar[ChangeKind] = ChangeKind.TOKENS_PER_BATCH

    tokens: int

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f"batches of at most {self.tokens:,} tokens"


StepChange = (
    PrecisionChange
    | CheckpointChange
    | InplaceChange
    | FreeGradientsChange
    | BatchSizeChange
    | LengthChange
    | TokensPerBatchChange
)
"""One change a replay can apply to the step."""


@dataclass(frozen=True)
class StrategyBuffers:
    """What a multi-process strategy holds on each rank beyond the module's own step, added to a replay by arithmetic.

    ``label`` names it (``"DDP gradient buckets"``); ``buffers`` are its allocations in bytes, each alive for the
    whole step; ``basis`` says how they were worked out (the strategy's settings and the rule applied). A replay
    holds them from the step's start: they are in each phase's peak and in its ``other``.
    """

    label: str
    buffers: tuple[int, ...]
    basis: str

    @property
    def total_bytes(self) -> int:
        """All its buffers, in bytes."""
        return sum(self.buffers)


@dataclass(frozen=True)
class ReplayedStep:
    """One training step replayed under fake tensors: what it would hold, without holding it.

    ``phases``: each phase's predicted live peak (every live tensor on the device, temporaries included, in the
    CUDA allocator's 512-byte blocks on CUDA, in bytes elsewhere) and its counted parts, with ``other`` the peak
    beyond them; ``step`` is the step replayed. ``modules``: what each module saved, as a sampled step's profile.
    ``loss_activation_bytes``: activations the loss's own ops saved (the log-softmax over the classes or
    vocabulary). ``seconds``: host time the replay took. ``notes``: what the replay could not size (an op whose
    fake kernel leaves out a workspace).
    """

    device_type: str
    precision: str
    batch_size: int | None
    phases: dict[Phase, PhasePeak]
    modules: tuple[ModuleProfile, ...]
    loss_activation_bytes: int
    seconds: float
    notes: tuple[str, ...] = ()
    timeline: StepTimeline | None = None
    """Live bytes op by op, by part (``None`` where not recorded: a step read back from JSON, which leaves it out)."""
    flops: int | None = None
    """The step's floating-point operations as ``torch.utils.flop_counter.FlopCounterMode`` counts them (matrix
    products, convolutions, attention; forward, backward with any recomputation, optimizer step); ``None`` where not
    counted (a step read back from JSON, which leaves it out)."""
    work: StepWork | None = field(default=None, compare=False, repr=False)
    """Every op of the step with its FLOPs and bytes moved, by phase (counted with :attr:`flops`; in memory only,
    not in JSON): what a step time is predicted from (:mod:`lightning_vram.prediction.step_time`)."""
    allocations: AllocationSequence | None = field(default=None, compare=False, repr=False)
    """The replay's allocation sequence, kept in memory only (not in JSON: ``None`` read back, and where no caching
    allocator was simulated): whether a caching allocator serves the step at a capacity is asked of it."""
    allocator: str | None = field(default=None, compare=False, repr=False)
    """The caching allocator's settings the phases' reserved peaks were simulated with (``PYTORCH_ALLOC_CONF`` as
    torch reads it, ``""``: torch's defaults); ``None`` with :attr:`allocations`."""
    strategy: StrategyBuffers | None = None
    """What the strategy holds beyond the step, in every phase's peak and ``other`` (``None``: nothing added)."""
    window_first: dict[Phase, PhasePeak] | None = field(default=None, compare=False, repr=False)
    """Under gradient accumulation, the phases of the window's first micro-batch (its gradients set to ``None``
    before backward, no optimizer step), beside :attr:`phases`, a later micro-batch and the optimizer step, which hold
    the most: for the baseline's match of a sampled first micro-batch, and in JSON a change's (a variant's
    ``window_first``), which ``lightning-vram diff`` sets against a run measuring a first micro-batch (``None``: no
    accumulation, or a baseline read back from JSON, or a file written before variants kept it)."""
    window_first_timeline: StepTimeline | None = field(default=None, compare=False, repr=False)
    """Under gradient accumulation, the window's first micro-batch op by op (its gradients appear as backward makes
    them, none held before): what a sharded strategy's per-rank arithmetic reads (ZeRO-1/2's reduce buckets); kept in
    memory only (``None``: no accumulation, or read back from JSON)."""

    @property
    def peak(self) -> PhasePeak:
        """The phase with the highest predicted peak (the first in step order on a tie)."""
        return max(self.phases.values(), key=lambda phase: phase.peak_bytes)

    def reported_bytes(self, phase: PhasePeak) -> int:
        """One of its phases' peak as the monitor's report measures peaks, in bytes: its predicted live peak.

        On CUDA the report's peaks are the allocator's, predicted here as every live tensor in 512-byte blocks; on
        the CPU they are the sampled step's live peaks, predicted here as every live tensor's bytes.
        """
        return phase.peak_bytes

    @property
    def reported_peak(self) -> PhasePeak:
        """The phase with the highest :meth:`reported_bytes` (the first in step order on a tie)."""
        return max(self.phases.values(), key=self.reported_bytes)

    @property
    def loss_activation_share(self) -> float:
        """The loss's share of the forward pass's saved activations (0 when there are none)."""
        forward = self.phases.get(Phase.FORWARD)
        activations = forward.breakdown.activations if forward is not None and forward.breakdown else 0
        return self.loss_activation_bytes / activations if activations else 0.0


@dataclass(frozen=True)
class ReplaySkipped:
    """A replay that could not run, or whose baseline did not match the measured step: ``reason`` says why."""

    reason: str
    seconds: float = 0.0


@dataclass(frozen=True)
class PartMatch:
    """One counted part of one phase: the sampled step's bytes against the replay's."""

    phase: Phase
    part: str
    measured_bytes: int
    replayed_bytes: int
    released_late_bytes: int = 0
    """Of a live peak's measured bytes, those another thread freed after the step's code had let go of them (gloo's
    worker thread keeps a finished collective's tensors until it gets the GIL: docs/measurement.md). The step without
    that delay peaked between ``measured_bytes - released_late_bytes`` and ``measured_bytes``."""

    @property
    def relative_error(self) -> float:
        """How far the replayed bytes are from the measured ones, as a share of the measured.

        ``|replayed - measured| / measured``, or, where some were released late, the distance to the nearer end of
        the range the step peaked in (0 inside it); 0 when both are 0, infinite when only the measured is 0.
        """
        lowest = self.measured_bytes - self.released_late_bytes
        if lowest <= self.replayed_bytes <= self.measured_bytes:
            difference = 0
        else:
            difference = min(abs(self.replayed_bytes - self.measured_bytes), abs(self.replayed_bytes - lowest))
        if self.measured_bytes == 0:
            return 0.0 if difference == 0 else float("inf")
        return difference / self.measured_bytes


@dataclass(frozen=True)
class BaselineMatch:
    """The replay of a sampled step against that step's counts, part by part, and the tolerance it must meet."""

    step: int
    parts: tuple[PartMatch, ...]
    tolerance: float
    window_first: bool = False
    """Under gradient accumulation, whether the sampled step was matched against the replay of its window's first
    micro-batch (:attr:`ReplayedStep.window_first`: no optimizer step), not the steady micro-batch with the optimizer
    step (:attr:`ReplayedStep.phases`) that the advice's figures are."""

    @property
    def matches(self) -> bool:
        """Whether every part is within the tolerance."""
        return all(part.relative_error <= self.tolerance for part in self.parts)

    @property
    def worst(self) -> PartMatch | None:
        """The part furthest from the measured count."""
        return max(self.parts, key=lambda part: part.relative_error, default=None)


@dataclass(frozen=True)
class VariantResult:
    """One change replayed: the step it predicts, or why it was discarded (it raised, or the time ran out)."""

    change: StepChange
    replayed: ReplayedStep | None
    discarded: str | None = None


@dataclass(frozen=True)
class PhaseCalibration:
    """One phase of the sampled step: the replay's allocated and reserved peaks against the allocator's, in bytes.

    ``replayed_*`` are the replay's own (before anything is carried), ``measured_*`` the allocator's readings on the
    sampled step: its peak allocated in the phase and its reserved memory at the phase's end (the cache only grows
    within a step, so that is the phase's reserved peak). A reserved figure is ``None`` where it is not known (no
    allocator model, or a device without allocator counters).
    """

    phase: Phase
    replayed_allocated_bytes: int
    measured_allocated_bytes: int
    replayed_reserved_bytes: int | None
    measured_reserved_bytes: int | None

    @property
    def unseen_bytes(self) -> int:
        """What the allocator held beyond the replay at the phase's peak (never negative): what the replay cannot see.

        >>> PhaseCalibration(Phase.FORWARD, 100, 164, None, None).unseen_bytes
        64
        >>> PhaseCalibration(Phase.FORWARD, 100, 90, None, None).unseen_bytes
        0
        """
        return max(self.measured_allocated_bytes - self.replayed_allocated_bytes, 0)

    @property
    def unseen_reserved_bytes(self) -> int:
        """What the allocator reserved beyond the simulated reserve (never negative; 0 where either is unknown)."""
        if self.replayed_reserved_bytes is None or self.measured_reserved_bytes is None:
            return 0
        return max(self.measured_reserved_bytes - self.replayed_reserved_bytes, 0)

    @property
    def allocated_error(self) -> float | None:
        """``(replayed - measured) / measured`` of the allocated peak (``None`` when nothing was measured).

        >>> PhaseCalibration(Phase.FORWARD, 97, 100, None, None).allocated_error
        -0.03
        """
        return _relative(self.replayed_allocated_bytes, self.measured_allocated_bytes)

    @property
    def reserved_error(self) -> float | None:
        """``(replayed - measured) / measured`` of the reserved peak (``None`` where either is unknown or 0)."""
        if self.replayed_reserved_bytes is None or self.measured_reserved_bytes is None:
            return None
        return _relative(self.replayed_reserved_bytes, self.measured_reserved_bytes)


def _relative(replayed: int, measured: int) -> float | None:
    return (replayed - measured) / measured if measured > 0 else None


@dataclass(frozen=True)
class Calibration:
    """The sampled step ``step`` measured beside its replay, phase by phase (the replay's error).

    What the allocator held beyond the replay (:attr:`PhaseCalibration.unseen_bytes`: cuDNN's convolution
    workspaces, cuBLASLt's, anything else the replay cannot see) is carried into every later prediction of the run,
    phase by phase.
    """

    step: int
    phases: tuple[PhaseCalibration, ...]

    @property
    def unseen_bytes(self) -> dict[Phase, int]:
        """Each phase's allocated bytes the replay cannot see, carried into the run's predictions."""
        return {phase.phase: phase.unseen_bytes for phase in self.phases}

    @property
    def unseen_reserved_bytes(self) -> dict[Phase, int]:
        """Each phase's reserved bytes beyond the simulated reserve, carried into the predicted reserved peaks."""
        return {phase.phase: phase.unseen_reserved_bytes for phase in self.phases}

    @property
    def carries(self) -> bool:
        """Whether anything is carried (some phase held more than the replay)."""
        return any(self.unseen_bytes.values()) or any(self.unseen_reserved_bytes.values())


class SavingFromMeasuredPeak:
    """A rank's peak now and under a change: the saving starts from the measured peak where known.

    A mixin of the trials below, whose fields (in bytes) these are.
    """

    current_peak_bytes: int
    measured_peak_bytes: int | None
    target_peak_bytes: int

    @property
    def start_bytes(self) -> int:
        """The rank's peak the saving starts from: measured where known, else predicted."""
        return self.current_peak_bytes if self.measured_peak_bytes is None else self.measured_peak_bytes

    @property
    def saving_bytes(self) -> int:
        """:attr:`start_bytes` less the target's predicted peak (negative: the target holds more)."""
        return self.start_bytes - self.target_peak_bytes


@dataclass(frozen=True)
class ShardingTrial(SavingFromMeasuredPeak):
    """One rank's step under the run's strategy and under the next stronger sharding at the same world size.

    Both are the per-rank model's predictions on the run's own step
    (:func:`~lightning_vram.prediction.strategies.predict_rank`), no collective run. ``current`` and ``target`` name
    the strategies as :class:`~lightning_vram.records.StrategySpec` does (``"deepspeed_stage_2"``, ``"fsdp"``), at
    ``world_size`` ranks, ``target_sharding`` the target's sharding (FSDP's ``"FULL_SHARD"``; ``None``: none),
    ``offload`` ZeRO-Offload kept as the run has it. Per strategy, in bytes: the highest phase peak on the device
    and its phase, and what this rank sends per optimizer step; ``target_host_bytes`` the host memory the target's
    offloaded state needs (0 without offload). ``reduce_bucket_size`` and ``allgather_bucket_size``: ZeRO's settings
    read from the run, in elements, which the target keeps (``None``: the run is not ZeRO). ``small_parameter_bytes``:
    for a ZeRO-3 target, the parameters of at most :data:`PERSISTENCE_THRESHOLD` elements, which DeepSpeed's default
    ``param_persistence_threshold`` would keep whole on every rank where the prediction partitions them (0
    otherwise). ``method``: how the target was predicted. ``measured_peak_bytes``: the sampled step's measured peak on
    this rank (the allocator's on CUDA, the live one on the CPU; ``None``: not measured), which the saving starts
    from where known: the run's own peak is a fact, the model's figure for it has its own error.
    """

    current: str
    target: str
    world_size: int
    offload: bool
    current_peak_bytes: int
    current_phase: Phase
    target_peak_bytes: int
    target_phase: Phase
    current_communication_bytes: int
    target_communication_bytes: int
    target_host_bytes: int
    method: str
    target_sharding: str | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    small_parameter_bytes: int = 0
    measured_peak_bytes: int | None = None

    @property
    def extra_communication_bytes(self) -> int:
        """What the target sends per optimizer step beyond the current strategy, in bytes (negative: less)."""
        return self.target_communication_bytes - self.current_communication_bytes


@dataclass(frozen=True)
class OffloadTrial(SavingFromMeasuredPeak):
    """One rank of a live sharded run that does not offload, predicted from the same replay with CPU offload.

    ``strategy``, ``world_size`` and ``sharding`` name the run's strategy as :class:`~lightning_vram.records.
    StrategySpec` does (``"deepspeed_stage_2"``, ``"fsdp2"``). In bytes: ``current_peak_bytes`` the per-rank model's
    peak for the run as it is, ``measured_peak_bytes`` the sampled step's (``None``: not measured), which the saving
    starts from where known; ``target_peak_bytes`` the device's peak with offload and ``target_phase`` its phase;
    ``host_bytes`` the host memory the offloaded tensors need on this rank; ``transfer_bytes`` what is copied
    between host and device per optimizer step. ``reduce_bucket_size`` and ``allgather_bucket_size``: ZeRO's
    settings read from the run, in elements, which the change keeps (``None``: not ZeRO). ``small_parameter_bytes``:
    under ZeRO-3, the bytes of the parameters DeepSpeed's default ``stage3_param_persistence_threshold`` would keep
    whole on every rank, which the prediction partitions (the change keeps the run's threshold 0). ``method``: how the
    offloaded rank was predicted.
    """

    strategy: str
    world_size: int
    current_peak_bytes: int
    target_peak_bytes: int
    target_phase: Phase
    host_bytes: int
    transfer_bytes: int
    method: str
    sharding: str | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    measured_peak_bytes: int | None = None
    small_parameter_bytes: int = 0


PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's (and Lightning's ``DeepSpeedStrategy``'s) default ``param_persistence_threshold``, in elements: ZeRO-3
keeps a parameter of at most this many elements whole on every rank once gathered."""


@dataclass(frozen=True)
class Simulation:
    """The replay of a run's sampled step and of each change tried on it.

    ``baseline`` is the replayed step, ``match`` its comparison with the sampled step's counts (``None`` when no
    counts were given), ``skipped`` why nothing was replayed or trusted (then ``variants`` is empty), and
    ``seconds`` the host time of all of it.
    """

    device_type: str
    baseline: ReplayedStep | None
    match: BaselineMatch | None
    skipped: str | None
    variants: tuple[VariantResult, ...]
    seconds: float
    fit: tuple[FitRow, ...] = ()
    """The largest batch per common GPU, each found by replaying batch sizes (empty when not searched)."""
    device_max_batch_size: int | None = None
    """The largest batch predicted to fit the run's own device, by replay (``None`` when not searched)."""
    fit_note: str | None = None
    """Why rows of ``fit`` are missing (the replay budget ran out, a replay failed); ``None`` when none is."""
    calibration: Calibration | None = None
    """The sampled step's allocator peaks beside the replay's, and what is carried (``None``: no allocator readings,
    as on the CPU, or no replay)."""
    allocator_conf: str | None = None
    """The caching allocator's settings the reserved peaks were simulated with (``PYTORCH_ALLOC_CONF`` form; ``""``
    for torch's defaults); ``None``: no reserved memory simulated."""
    expandable_reserved_bytes: dict[Phase, int] | None = None
    """Each phase's simulated reserved peak of the baseline's own allocations with ``expandable_segments:True``
    (``None``: not simulated, as where the run already has them)."""
    accumulate_grad_batches: int = 1
    """The run's ``accumulate_grad_batches`` the step was replayed with (above 1: a window's micro-batches)."""
    sharding: ShardingTrial | None = None
    """Under DeepSpeed ZeRO-1/2, this rank under the next stronger ZeRO stage beside its own strategy, both by the
    per-rank model (``None``: not a run whose sharding can grow, or not predicted)."""
    offload: OffloadTrial | None = None
    """On CUDA, a rank of a sharded run that does not offload, near the device's capacity: the rank predicted with CPU
    offload (``None``: not such a run, or not predicted)."""
    strategy_name: str | None = None
    """The multi-process strategy the run's rank was replayed under, as :class:`~lightning_vram.records.strategy.
    StrategySpec` names it (``"ddp"``, ``"fsdp2"``, ``"fsdp"``, ``"deepspeed_stage_3"``); ``None``: one process, or
    not recorded (a file written before it was)."""


@dataclass(frozen=True)
class PreflightRemedy:
    """A change replayed on the first step before it ran: its label and the replayed peak with it, in bytes.

    ``reserved_peak_bytes``: the simulated caching allocator's peak with it (``None``: not simulated); ``served``:
    whether the simulated allocator serves the step with it at the memory available (``None``: not simulated, the
    tensor peak is compared instead).
    """

    label: str
    peak_bytes: int
    reserved_peak_bytes: int | None = None
    served: bool | None = None
    accumulation: str | None = None
    """For a smaller batch: the micro-batch and ``accumulate_grad_batches`` that keep the run's global batch, as the
    warning says them (:func:`~lightning_vram.records.advice.accumulation_text`); ``None`` for other changes."""


@dataclass(frozen=True)
class PreflightVerdict:
    """The first step replayed against the device before it ran (preflight), in bytes.

    ``needed_bytes`` = replayed peak - allocated now; ``available_bytes`` = free + cached but unallocated.
    ``remedies`` are the changes replayed, largest saving first (only when the step does not fit). ``served``:
    whether the simulated caching allocator serves the whole step in the device's memory (free + reserved now);
    ``None`` where it was not simulated.
    """

    step: ReplayedStep
    needed_bytes: int
    available_bytes: int
    remedies: tuple[PreflightRemedy, ...]
    served: bool | None = None
    shortfall: str | None = None
    """Where the simulated allocator failed and what it was asked for (``None``: served, or not simulated)."""

    @property
    def fits(self) -> bool:
        """Whether the step is predicted to fit: served by the simulated allocator, else its tensor peak fits."""
        return self.served if self.served is not None else self.needed_bytes <= self.available_bytes

    def remedy_fits(self, remedy: PreflightRemedy) -> bool:
        """Whether the step fits with ``remedy``: served by the simulated allocator, else its tensor peak fits."""
        if remedy.served is not None:
            return remedy.served
        return remedy.peak_bytes - (self.step.peak.peak_bytes - self.needed_bytes) <= self.available_bytes


@dataclass(frozen=True)
class RankPreflight:
    """One rank's preflight verdict as every rank agreed on it before step 0 (one gather), in bytes.

    ``fits``: whether the rank's first step is predicted to fit (:attr:`PreflightVerdict.fits`); ``None`` where the
    rank's preflight was skipped (``skipped`` says why on that rank; the other ranks see ``None``: a reason is text,
    and the gather carries numbers). ``needed_bytes`` and ``available_bytes`` as in :class:`PreflightVerdict`,
    ``peak_bytes`` the rank's replayed peak; ``None`` where skipped.
    """

    rank: int
    fits: bool | None
    needed_bytes: int | None = None
    available_bytes: int | None = None
    peak_bytes: int | None = None
    skipped: str | None = None

    @classmethod
    def of(cls, rank: int, outcome: PreflightVerdict | str) -> RankPreflight:
        """Rank ``rank``'s row: its verdict, or the reason its preflight was skipped."""
        if isinstance(outcome, str):
            return cls(rank, None, skipped=outcome)
        return cls(rank, outcome.fits, outcome.needed_bytes, outcome.available_bytes, outcome.step.peak.peak_bytes)


def advised_variant(simulation: Simulation | None, advice: tuple[Advice, ...]) -> VariantResult | None:
    """The replayed change behind the first piece of ``advice`` whose saving was simulated, if any.

    The advice names its change (``replayed_change``, the variant's label). A report written before it did: a
    simulated saving quotes its change's replayed peak (``predicted_peak_bytes``), and the variant is the first
    replayed change with that peak as the report measures peaks.
    """
    if simulation is None or simulation.skipped is not None:
        return None
    for item in advice:
        if item.saving_basis is not SavingBasis.SIMULATED or item.predicted_peak_bytes is None:
            continue
        if item.replayed_change is not None:
            named = [variant for variant in simulation.variants if variant.change.label == item.replayed_change]
            if named and named[0].replayed is not None:
                return named[0]
        for variant in simulation.variants:
            replayed = variant.replayed
            if (
                replayed is not None
                and replayed.phases  # a report edited by hand may hold none
                and replayed.reported_bytes(replayed.reported_peak) == item.predicted_peak_bytes
            ):
                return variant
    return None
