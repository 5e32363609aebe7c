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
    """

    name: str
    type: str
    activation_bytes: int
    input_bytes: int = 0
    output_bytes: int = 0
    inplace: bool | None = None
    input_saved_for_backward: bool = False


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
    """

    id: str
    severity: str
    title: str
    detail: str
    evidence: str
    estimated_saving_bytes: int | None
    estimated_saving_seconds: float | None = None


@dataclass(frozen=True)
class LinearLayer:
    """One ``nn.Linear`` of the model and its parameter bytes."""

    name: str
    in_features: int
    out_features: int
    parameter_bytes: int


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
    """Which modules to checkpoint, and the activation bytes that should save at the peak."""

    container: str
    units: tuple[tuple[str, ...], ...]
    sequential_segments: int | None
    saving_bytes: int


@dataclass(frozen=True)
class FitRow:
    """The largest batch of this run predicted to fit on a device of ``capacity_bytes``."""

    device: str
    capacity_bytes: int
    max_batch_size: int


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
