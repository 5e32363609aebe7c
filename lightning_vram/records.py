"""Frozen records that pass between the monitor's parts: what is measured, advised and reported.

All sizes are integer bytes, all times seconds. ``None`` means "not measured here", never zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import NamedTuple


class Phase(str, Enum):
    """A part of one training step, in Lightning's hook order."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class DeviceInfo:
    """The monitored device: ``type`` is a torch device type, ``total_bytes`` its memory capacity.

    ``compute_capability`` is CUDA's ``(major, minor)``, ``None`` elsewhere.
    """

    type: str
    name: str
    index: int | None
    total_bytes: int | None
    compute_capability: tuple[int, int] | None = None


class AllocatorReading(NamedTuple):
    """CUDA caching-allocator counters read at one phase boundary, in bytes.

    ``peak_allocated_bytes`` is the highest allocated value since the last peak reset (or since the
    process started, when the monitor leaves the process-wide peak untouched).
    ``alloc_retries`` counts allocations that had to free cached blocks and retry (a sign of pressure);
    ``ooms`` counts out-of-memory errors the allocator raised since the process started.
    """

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    alloc_retries: int
    ooms: int = 0


@dataclass(frozen=True)
class UtilizationReading:
    """NVML samples averaged over one interval.

    ``gpu_utilization_percent``: mean percent of time one or more kernels ran (NVML's definition).
    ``process_memory_bytes``: this process's device memory as NVML sees it (CUDA context included).
    """

    gpu_utilization_percent: float | None
    process_memory_bytes: int | None


@dataclass(frozen=True)
class NotMeasured:
    """Something the report could not measure in this environment, and why."""

    what: str
    reason: str


@dataclass(frozen=True)
class Breakdown:
    """Memory held at one moment, split by what holds it, in bytes.

    ``other`` is what the allocator saw beyond the counted parts (batch, temporaries, workspaces);
    it is ``None`` where no allocator peak exists (CPU).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    other: int | None

    @property
    def largest_part(self) -> str:
        """The category holding the most bytes (``other`` only where measured); ties go to the first listed."""
        parts = {name: value for name, value in self.to_dict().items() if value is not None}
        return max(parts, key=lambda name: parts[name])

    @property
    def counted_bytes(self) -> int:
        """Bytes of the parts counted tensor by tensor (everything but ``other``)."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def with_measured_peak(self, peak_bytes: int) -> Breakdown:
        """The same breakdown with ``other`` set to what an allocator peak holds beyond the counted parts.

        Counts and the allocator are read at different instants of a phase, so the remainder is
        clamped at zero.
        """
        return Breakdown(
            parameters=self.parameters,
            gradients=self.gradients,
            optimizer_state=self.optimizer_state,
            activations=self.activations,
            other=max(peak_bytes - self.counted_bytes, 0),
        )

    def to_dict(self) -> dict[str, int | None]:
        """The schema's ``breakdown`` object."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "other": self.other,
        }


@dataclass(frozen=True)
class ModuleProfile:
    """What one module did during a sampled forward pass, in bytes, summed over its calls.

    ``activation_bytes``: tensors it saved for backward itself (not its children's).
    ``input_bytes`` / ``output_bytes``: unique storages of its tensor arguments and results.
    ``inplace``: its ``inplace`` flag where it has one (activation modules), else ``None``.
    ``input_saved_for_backward``: autograd already held its input for an earlier op when it ran,
    so an inplace version would break backward.
    ``input_saved_bytes`` / ``output_saved_bytes``: its input / output storages that it or its submodules
    saved for backward during its calls.
    ``output_saved_for_backward``: autograd held its output when the forward pass ended, saved by it or by a
    later op (observed for modules with an ``inplace`` flag only).
    ``input_feature_map``: ``(channels, positions)`` of the convolutional feature map (the output of a Conv,
    Pool or BatchNorm layer) a ``Linear`` read flattened, else ``None``.
    """

    name: str
    type: str
    activation_bytes: int
    input_bytes: int = 0
    output_bytes: int = 0
    inplace: bool | None = None
    input_saved_for_backward: bool = False
    input_saved_bytes: int = 0
    output_saved_bytes: int = 0
    output_saved_for_backward: bool = False
    input_feature_map: tuple[int, int] | None = None


@dataclass(frozen=True)
class Attribution:
    """Tensor-by-tensor counts of one sampled step.

    The counted parts at each phase's counted peak, every module called in its forward pass (in
    registration order), and the batch's first dimension.
    """

    step: int
    phases: dict[Phase, Breakdown]
    modules: tuple[ModuleProfile, ...]
    batch_size: int | None = None


@dataclass(frozen=True)
class EvaluationPeak:
    """The highest allocator peak of one evaluation batch: ``stage`` is validation, test or predict.

    ``after_step`` is the number of training batches run before it (0 for a sanity check or a standalone run).
    """

    stage: str
    peak_bytes: int
    reserved_bytes: int
    after_step: int


@dataclass(frozen=True)
class PhasePeak:
    """The peak of one phase of one step.

    ``peak_bytes`` is the allocator's peak on CUDA and the sum of the counted parts on CPU;
    ``reserved_bytes`` is the allocator's reserve at the end of the phase (``None`` on CPU).
    """

    step: int
    phase: Phase
    peak_bytes: int
    reserved_bytes: int | None
    breakdown: Breakdown | None


@dataclass(frozen=True)
class StepPoint:
    """The peak of one step, for charts of memory over steps."""

    step: int
    peak_bytes: int


@dataclass(frozen=True)
class IntervalMemory:
    """Memory over one log interval: the counters at its end and its highest peaks, in bytes."""

    allocated_bytes: int | None
    reserved_bytes: int | None
    peak: PhasePeak | None
    phase_peak_bytes: dict[Phase, int]


@dataclass(frozen=True)
class IntervalTiming:
    """Timing over one log interval: mean step time in seconds and the share of it spent waiting for data."""

    step_seconds: float | None
    data_wait_fraction: float | None


@dataclass(frozen=True)
class Advice:
    """One piece of advice: what to change, the figures that fired it, and what it should save.

    ``estimated_saving_bytes`` is peak memory; ``estimated_saving_seconds`` is time per step (speed advice).
    ``saving_basis`` says where the byte saving comes from: ``"simulated"`` (the change was replayed on the run's own
    step under fake tensors), ``"modelled"`` (a formula over the measurements), ``None`` without a byte saving.
    ``predicted_peak_bytes`` is the replayed peak after the change, wherever the change was replayed (also without a
    byte saving: mixed precision advised for speed says what its replay predicts).
    """

    id: str
    severity: str
    title: str
    detail: str
    evidence: str
    estimated_saving_bytes: int | None
    estimated_saving_seconds: float | None = None
    saving_basis: str | None = None
    predicted_peak_bytes: int | None = None


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of the model and its parameter bytes.

    ``weight_bytes``: bytes of its own weight; 0 where the weight is shared with another module (tied weights
    count once, with the module they are tied to).
    """

    name: str
    in_features: int
    out_features: int
    parameter_bytes: int
    weight_bytes: int = 0


@dataclass(frozen=True)
class TrainingSetup:
    """How the user set up training, read from the Trainer (or given to a session) and the model."""

    precision: str
    automatic_optimization: bool
    accumulate_grad_batches: int
    optimizers: tuple[str, ...]
    num_workers: int | None
    pin_memory: bool | None
    cpu_cores_per_device: int
    world_size: int
    strategy: str
    parameter_bytes: int
    linear_layers: tuple[LinearLayer, ...]
    inplace_keeps_result: tuple[str, ...] = ()
    """Out-of-place activation modules (by name) whose inplace variant saves only its result for backward,
    as tried on a small tensor: inplace, their input and output become one saved tensor."""


@dataclass(frozen=True)
class RunSummary:
    """What the run measured, as the rules and the report need it. ``None`` means not measured here.

    ``modules`` holds every module of the sampled step with the most activations (registration order);
    ``recent_peaks`` the last steps' peaks; ``evaluation`` each evaluation stage's highest batch peak.
    """

    device: DeviceInfo
    peak: PhasePeak | None
    phases: dict[Phase, PhasePeak]
    modules: tuple[ModuleProfile, ...]
    batch_size: int | None
    step_seconds_median: float | None
    data_wait_fraction: float | None
    recent_data_wait_fraction: float | None
    timed_steps: int
    gpu_utilization_mean: float | None
    alloc_retries: int | None
    cuda_context_bytes: int | None
    recovered_ooms: int | None = None
    last_step: tuple[PhasePeak, ...] = ()
    steps: int = 0
    recent_peaks: tuple[StepPoint, ...] = ()
    evaluation: tuple[EvaluationPeak, ...] = ()

    @property
    def on_cuda(self) -> bool:
        """Whether the run trained on a CUDA device."""
        return self.device.type == "cuda"


@dataclass(frozen=True)
class CheckpointPlan:
    """Which modules to checkpoint, and the activation bytes that should save at the peak.

    ``units`` are the checkpointed units, each the names of the children of ``container`` it runs, in order;
    ``forward_of`` is the module whose forward calls them (``container`` itself, or the parent of an
    ``nn.ModuleList``; ``""`` for the LightningModule). With ``sequential_segments``, ``container`` is an
    ``nn.Sequential`` run by ``checkpoint_sequential`` with that many segments (the last one not checkpointed).
    """

    container: str
    units: tuple[tuple[str, ...], ...]
    sequential_segments: int | None
    saving_bytes: int
    forward_of: str | None = None


@dataclass(frozen=True)
class FitRow:
    """The largest batch of this run predicted to fit on a device of ``capacity_bytes``."""

    device: str
    capacity_bytes: int
    max_batch_size: int
    basis: str = "modelled"
    """``"simulated"`` when each batch size was replayed (a bisection), ``"modelled"`` when extrapolated linearly."""
    at_least: bool = False
    """The search stopped at its largest batch size, which still fit: the largest that fits is this or more."""

    @property
    def batch_text(self) -> str:
        """The batch size as a report shows it: ``"at least 65536"`` where the search hit its bound.

        >>> FitRow("A100", 80, 65536, "simulated", at_least=True).batch_text
        'at least 65536'
        """
        return f"at least {self.max_batch_size}" if self.at_least else str(self.max_batch_size)


@dataclass(frozen=True)
class TimingSummary:
    """Run timing: median step in seconds, share of step time waiting for data, mean GPU utilization in percent."""

    step_seconds_median: float | None
    data_wait_fraction: float | None
    gpu_utilization_mean: float | None


@dataclass(frozen=True)
class RankSummary:
    """One process's headline: its global rank, device index and highest peak in bytes."""

    rank: int
    device_index: int | None
    peak_bytes: int | None
    steps: int


@dataclass(frozen=True)
class Report:
    """Everything the monitor learned about one run: the run's summary and what was derived from it.

    ``modules`` are the modules that saved the most activations, largest first (at most ``top_modules``).
    """

    summary: RunSummary
    precision: str | None
    modules: tuple[ModuleProfile, ...]
    advice: tuple[Advice, ...]
    fit: tuple[FitRow, ...]
    ranks: tuple[RankSummary, ...]
    not_measured: tuple[NotMeasured, ...] = field(default=())
    simulation: Simulation | None = None
    """The replay of the run's sampled step and of each change tried on it (``None`` when none ran)."""

    @property
    def device(self) -> DeviceInfo:
        """The monitored device."""
        return self.summary.device

    @property
    def steps(self) -> int:
        """Training batches monitored."""
        return self.summary.steps

    @property
    def peak(self) -> PhasePeak | None:
        """The highest phase peak of the run."""
        return self.summary.peak

    @property
    def phases(self) -> dict[Phase, PhasePeak]:
        """The highest peak of each phase."""
        return self.summary.phases

    @property
    def batch_size(self) -> int | None:
        """The batch's first dimension on the sampled step."""
        return self.summary.batch_size

    @property
    def recovered_ooms(self) -> int | None:
        """CUDA out-of-memory errors the training code caught and survived."""
        return self.summary.recovered_ooms

    @property
    def recent_peaks(self) -> tuple[StepPoint, ...]:
        """The last steps' peaks."""
        return self.summary.recent_peaks

    @property
    def evaluation(self) -> tuple[EvaluationPeak, ...]:
        """The highest evaluation-batch peak of each stage."""
        return self.summary.evaluation

    @property
    def timing(self) -> TimingSummary:
        """Step time, data wait and GPU utilization over the run."""
        summary = self.summary
        return TimingSummary(summary.step_seconds_median, summary.data_wait_fraction, summary.gpu_utilization_mean)

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-ready data, exactly as written to ``vram_report.json``."""
        from lightning_vram.codec import report_to_dict  # the codec imports this module

        return report_to_dict(self)


@dataclass(frozen=True)
class OomMessage:
    """The figures in torch's CUDA out-of-memory message, in bytes (rounded as torch prints them).

    Each is ``None`` when the message does not carry it (older torch versions, other allocators).
    """

    tried_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None


@dataclass(frozen=True)
class OomDiagnosis:
    """What the monitor knew when a CUDA out-of-memory error ended training, on one rank.

    ``where`` is ``forward``, ``backward``, ``optimizer`` or ``validation``; sizes are bytes. ``allocated_bytes``
    and ``reserved_bytes`` come from torch's message when it has them, else from the allocator's last reading.
    ``breakdown`` is at the failure: model state counted then, activations from the last sampled step.
    """

    where: str
    step: int
    rank: int
    message: OomMessage
    capacity_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    breakdown: Breakdown | None
    last_good_step: tuple[PhasePeak, ...]
    advice: tuple[Advice, ...]
    notes: tuple[str, ...]
    snapshot: Path | None

    @property
    def needed_more_bytes(self) -> int | None:
        """How much more the failing allocation needed than the device had free."""
        tried, free = self.message.tried_bytes, self.message.free_bytes
        if tried is None or free is None:
            return None
        return max(tried - free, 0)

    def headline(self) -> str:
        """One line: what was needed, where, and what held the most."""
        from lightning_vram.render.text import oom_headline  # the renderers import this module

        return oom_headline(self)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form, as written to ``vram_oom_report.json``."""
        from lightning_vram.codec import oom_diagnosis_to_dict  # the codec imports this module

        return oom_diagnosis_to_dict(self, self.headline())


# ---------------------------------------------------------------------------------------------------- step replay


@dataclass(frozen=True)
class PrecisionChange:
    """Replay the step in another precision, named as Lightning names it (``"bf16-mixed"``, ``"bf16-true"``...)."""

    precision: str

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f'precision="{self.precision}"'


@dataclass(frozen=True)
class CheckpointChange:
    """Replay the step with ``plan``'s units wrapped in non-reentrant activation checkpointing."""

    plan: CheckpointPlan

    @property
    def label(self) -> str:
        """How the report names the change."""
        plan = self.plan
        where = plan.container or "the model"
        if plan.sequential_segments is not None:
            return f"checkpoint {where} in {plan.sequential_segments} segments"
        first, last = plan.units[0][0], plan.units[-1][-1]
        if len(plan.units) == 1:
            return f"checkpoint {'+'.join(plan.units[0])}"
        return f"checkpoint {len(plan.units)} units of {where} ({first} to {last})"


@dataclass(frozen=True)
class InplaceChange:
    """Replay the step with ``inplace=True`` set on the named activation modules."""

    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f"inplace activations in {len(self.modules)} module(s)"


@dataclass(frozen=True)
class FreeGradientsChange:
    """Replay the step with the previous step's gradients set to ``None`` before the forward pass."""

    @property
    def label(self) -> str:
        """How the report names the change."""
        return "gradients set to None before forward"


@dataclass(frozen=True)
class BatchSizeChange:
    """Replay the step with every batch tensor's first dimension (the batch size) set to ``batch_size``."""

    batch_size: int

    @property
    def label(self) -> str:
        """How the report names the change."""
        return f"batch size {self.batch_size}"


StepChange = PrecisionChange | CheckpointChange | InplaceChange | FreeGradientsChange | BatchSizeChange
"""One change a replay can apply to the step."""


@dataclass(frozen=True)
class ReplayedStep:
    """One training step replayed under fake tensors: what it would hold, without holding it.

    ``phases``: each phase's predicted allocator peak (every live tensor on the device, temporaries included, in
    the CUDA allocator's 512-byte blocks) and its counted parts, with ``other`` the peak beyond them; ``step`` is
    the step replayed. ``modules``: what each module saved, as a sampled step's profile. ``loss_activation_bytes``:
    activations the loss's own ops saved (the log-softmax over the classes or vocabulary). ``seconds``: host time
    the replay took. ``notes``: what the replay could not size (an op whose fake kernel leaves out a workspace).
    """

    device_type: str
    precision: str
    batch_size: int | None
    phases: dict[Phase, PhasePeak]
    modules: tuple[ModuleProfile, ...]
    loss_activation_bytes: int
    seconds: float
    notes: tuple[str, ...] = ()

    @property
    def peak(self) -> PhasePeak:
        """The phase with the highest predicted peak (the first in step order on a tie)."""
        return max(self.phases.values(), key=lambda phase: phase.peak_bytes)

    def reported_bytes(self, phase: PhasePeak) -> int:
        """One of its phases' peak as the monitor's report measures peaks, in bytes.

        On CUDA the report's peaks are the allocator's, so this is the predicted allocator peak; elsewhere they are
        the sums of the counted parts, so this is the phase's counted parts.
        """
        if self.device_type == "cuda" or phase.breakdown is None:
            return phase.peak_bytes
        return phase.breakdown.counted_bytes

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

    @property
    def relative_error(self) -> float:
        """``|replayed - measured| / measured``; 0 when both are 0, infinite when only the measured is 0."""
        difference = abs(self.replayed_bytes - self.measured_bytes)
        if self.measured_bytes == 0:
            return 0.0 if difference == 0 else float("inf")
        return difference / self.measured_bytes


@dataclass(frozen=True)
class BaselineMatch:
    """The replay of a sampled step against that step's counts, part by part, and the tolerance it must meet."""

    step: int
    parts: tuple[PartMatch, ...]
    tolerance: float

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


@dataclass(frozen=True)
class Prediction:
    """What a training step would hold, predicted without training: :func:`lightning_vram.predict`'s result.

    ``step`` is the replayed steady-state step (``None`` with ``skipped`` saying why), ``fit`` the largest batch
    predicted to fit each common GPU (with ``cuda_context_bytes`` and a safety margin kept free), ``notes`` what
    the prediction could not reproduce.
    """

    step: ReplayedStep | None
    fit: tuple[FitRow, ...]
    cuda_context_bytes: int
    skipped: str | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PreflightRemedy:
    """A change replayed on the first step before it ran: its label and the replayed peak with it, in bytes."""

    label: str
    peak_bytes: int


@dataclass(frozen=True)
class PreflightVerdict:
    """The first step replayed against the device before it ran (preflight), in bytes.

    ``needed_bytes`` = replayed peak - allocated now; ``available_bytes`` = free + cached but unallocated.
    ``remedies`` are the changes replayed, largest saving first (only when the step does not fit).
    """

    step: ReplayedStep
    needed_bytes: int
    available_bytes: int
    remedies: tuple[PreflightRemedy, ...]

    @property
    def fits(self) -> bool:
        """Whether the step is predicted to fit."""
        return self.needed_bytes <= self.available_bytes
