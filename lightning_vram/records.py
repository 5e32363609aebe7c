"""Frozen records that pass between the monitor's parts.

All sizes are integer bytes. ``None`` means "not measured here", never zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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


@dataclass(frozen=True)
class AllocatorReading:
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
