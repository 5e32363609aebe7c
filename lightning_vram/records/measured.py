"""What the monitor measures: phases, devices, readings, breakdowns, module profiles, peaks, set-up, the run.

Also the domain facts every part shares: the parts of a breakdown (:data:`CATEGORIES`), the parts counted tensor by
tensor (:data:`COUNTED_PARTS`) and the phases in step order (:func:`in_phase_order`).
All sizes are integer bytes, all times seconds. ``None`` means "not measured here", never zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Phase(str, Enum):
    """A part of one training step, in Lightning's hook order."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
"""The parts of a breakdown, in the order every table shows them."""
COUNTED_PARTS = CATEGORIES[:4]
"""The parts a replay's baseline is compared with the measured step on (``other`` is not counted)."""
LIVE_PEAK_PART = "live peak"
"""The baseline's part for a phase's live peak, compared where the sampled step counted every live tensor (CPU)."""
MATCHED_PARTS = (*COUNTED_PARTS, LIVE_PEAK_PART)
"""Every part a baseline match may compare: the counted parts and the live peak."""


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

    ``other`` is what the peak held beyond the counted parts (batch, temporaries, the loss's logits and their
    gradient, workspaces): on CUDA the allocator's peak, on the CPU the live peak of a sampled step (every tensor
    alive, counted as it runs); ``None`` where neither was measured.
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

    @property
    def peak_bytes(self) -> int:
        """The peak it breaks down, in bytes: the counted parts and ``other`` (alone where ``other`` is ``None``)."""
        return self.counted_bytes + (self.other or 0)

    def with_measured_peak(self, peak_bytes: int) -> Breakdown:
        """The same breakdown with ``other`` set to what a measured peak holds beyond the counted parts.

        The peak is the allocator's on CUDA, the live one on the CPU. Counts and the peak are read at different
        instants of a phase, so the remainder is clamped at zero.
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
    Pool or BatchNorm layer) a ``Linear`` read flattened, else ``None``; ``input_feature_map_dims``: that map's
    dimensions past its channels (1, 2 or 3: the pooling layer that fits it), ``None`` where not read.
    ``calls``: how many times the forward pass called it (a block's one ReLU, called twice, sums both calls).
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
    calls: int = 1
    input_feature_map_dims: int | None = None


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
    recomputed_units: tuple[tuple[str, ...], ...] | None = None
    """What activation checkpointing re-ran in backward: per recomputed unit, in the order backward recomputed them,
    the outermost modules it re-ran (names as in ``modules``; torch may stop a recomputation before a unit's last
    modules, once backward has what it needs). Empty: nothing re-ran; ``None``: not recorded (an older state)."""
    selective_units: tuple[str, ...] | None = None
    """The first module of each of :attr:`recomputed_units` that torch's selective checkpointing re-ran
    (``create_selective_checkpoint_contexts``: the outputs its policy kept from forward read back, the other ops
    recomputed); the others re-ran whole. ``None``: not recorded (an older state)."""
    micro_batch: int | None = None
    """Under gradient accumulation, the step's place in its window: 1 for the window's first micro-batch (no
    gradients held before it), the window's length for the one whose optimizer steps. ``None``: not accumulating, or
    its place not known (a run resumed before its first optimizer step)."""


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

    ``peak_bytes`` is the allocator's peak on CUDA; on the CPU the live peak of a sampled step (every tensor alive,
    temporaries included), or the sum of the counted parts where the live count stood aside;
    ``reserved_bytes`` is the allocator's reserve at the end of the phase (``None`` on CPU); in a replayed step on
    CUDA, the simulated caching allocator's reserved peak over the phase
    (:mod:`~lightning_vram.prediction.replay.reserved`).
    """

    step: int
    phase: Phase
    peak_bytes: int
    reserved_bytes: int | None
    breakdown: Breakdown | None
    micro_batch: int | None = None
    """Under gradient accumulation, the step's place in its window, where the step was sampled
    (:attr:`Attribution.micro_batch`); ``None``: not accumulating, or not known."""


def in_phase_order(phases: dict[Phase, PhasePeak]) -> list[tuple[Phase, PhasePeak]]:
    """The phases present, in the order a training step runs them."""
    return [(phase, phases[phase]) for phase in Phase if phase in phases]


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
class CheckpointSwitch:
    """A library model that checkpoints all its layers with one call of its own (transformers' models).

    ``model``: its name in the trained module (``""``: the module itself); ``method``: the call that turns
    checkpointing on (``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` where the library
    has no other); ``layers``: the layers that call checkpoints, by name, in registration order (every stack's:
    an encoder's and a decoder's together); ``on``: the model checkpoints them already.
    """

    model: str
    method: str
    layers: tuple[str, ...]
    on: bool = False


class TrainingLoop(str, Enum):
    """What trains the model, for the code an advice prints: where its lines go and what names the model."""

    LIGHTNING = "lightning"
    """A Trainer fits a LightningModule: lines in its ``__init__``, the model is ``self``."""
    PLAIN = "plain"
    """A plain loop measured by ``VramSession``: lines after the model is built, the model is ``model``."""
    FABRIC = "fabric"
    """A Fabric loop measured by ``VramSession``: lines before ``fabric.setup``, the model is ``model``."""


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
    checkpointing_switches: tuple[CheckpointSwitch, ...] = ()
    """The library models in the module that turn checkpointing on themselves, off or on."""
    visible_devices: int = 1
    """Accelerator devices this process can see (``torch.cuda.device_count()``, 0 without CUDA): with one process
    and at most one device, there is nothing to shard across."""
    language_model: str | None = None
    """Why the model looks like a transformer or a language model (``"attention modules (GPT2Attention)"``), or
    ``None`` when nothing says so: the advice then weighs what a change of optimizer does to convergence."""
    longest_sample: int | None = None
    """The longest sample the training DataLoader will yield (elements along the batch's length), where it tells: its
    sampler knows every sample's length (a length-grouped sampler's ``lengths``), or its collator pads every batch to
    its ``max_length``; ``None`` where it does not say."""
    iterable_dataset: bool = False
    """Whether the training DataLoader reads an ``IterableDataset``: each worker process then runs its own copy of
    ``__iter__``, so a stream not split by ``torch.utils.data.get_worker_info()`` is yielded once per worker."""
    loader_batch_size: int | None = None
    """The training DataLoader's ``batch_size`` (``None``: it has none, its dataset or batch sampler makes the
    batches; or no DataLoader is known): the run of samples each worker takes in turn, where an ``IterableDataset``'s
    stream is split by worker so that the workers' batches are one process's."""
    loop: TrainingLoop = TrainingLoop.LIGHTNING
    """What trains the model (a Trainer, a plain loop, Fabric): the advice's code is written for it."""
    own_zero_grad: bool = False
    """Whether the LightningModule overrides ``optimizer_zero_grad``: when gradients are zeroed is then its own (it
    may keep them across batches, accumulating by its own hooks), not Lightning's accumulation window."""
    keyed_containers: tuple[str, ...] = ()
    """The modules (by name) that hold their children by key (``nn.ModuleDict``): code reaches a child of one as
    ``["key"]`` (a key ``"0"`` read as ``[0]`` raised KeyError, ``.key`` fails for a key that is no identifier)."""

    @property
    def lightning_zeroes_gradients(self) -> bool:
        """Whether Lightning zeroes the gradients, at each accumulation window's start.

        It does under automatic optimization with no ``optimizer_zero_grad`` of the module's own. Otherwise the step
        may keep them across batches, and freeing them at a batch's start would discard them.
        """
        return self.automatic_optimization and not self.own_zero_grad

    @property
    def lightning_accumulates(self) -> bool:
        """Whether Lightning's ``accumulate_grad_batches`` accumulates this run's gradients.

        Under manual optimization Lightning refuses it (a MisconfigurationException at fit), and a plain or Fabric
        loop has no such setting: the run's own code accumulates.
        """
        return self.loop is TrainingLoop.LIGHTNING and self.automatic_optimization

    @property
    def autocast_caches(self) -> bool:
        """Whether a ``*-mixed`` step's autocast caches its cast weights, as the run's precision plugin has it.

        Off under a Trainer's ``MixedPrecision`` plugin (``cache_enabled=False``); on under a Trainer's FSDP plugin,
        Fabric's plugins and a plain loop's own ``torch.autocast`` (torch's default).

        >>> TrainingSetup("bf16-mixed", True, 1, (), None, None, 1, 1, "FSDPStrategy", 0, ()).autocast_caches
        True
        """
        return self.loop is not TrainingLoop.LIGHTNING or self.strategy == "FSDPStrategy"

    @property
    def fabric_forward(self) -> bool:
        """Whether the precision applies to the module's forward only, as Fabric's ``_FabricModule`` applies it.

        Fabric converts the forward's floating inputs to the precision's dtype, runs it under the precision and
        converts its floating outputs to ``float32``; a Trainer's plugin runs the whole ``training_step`` under it.
        """
        return self.loop is TrainingLoop.FABRIC


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
    length_counts: tuple[tuple[int, int], ...] = ()
    """Each training batch length seen (tokens) with how many batches had it, shortest first (empty: none)."""
    length_peaks: tuple[tuple[int, int], ...] = ()
    """Each batch length replayed on a training step (tokens) with its replayed peak (bytes), shortest first."""
    recomputed_units: tuple[tuple[str, ...], ...] | None = None
    """What activation checkpointing re-ran in backward on the sampled step (:attr:`Attribution.recomputed_units`;
    ``None``: not recorded)."""
    selective_units: tuple[str, ...] | None = None
    """Of those, the units torch's selective checkpointing re-ran, by their first module
    (:attr:`Attribution.selective_units`; ``None``: not recorded)."""
    step_time_iqr_fraction: float | None = None
    """How much the recent steps' times vary: their interquartile range over their median, a fraction (``None``: not
    measured, fewer than four steps timed, or an older report)."""
    optimizer_steps: int | None = None
    """Optimizer steps the run took (``before_optimizer_step`` calls, as Lightning's ``global_step`` counts them: one
    per accumulation window, one per ``opt.step()`` under manual optimization); ``steps`` counts batches. ``None``:
    not counted (an older report, or a run resumed from a state that did not count them)."""
    accumulate_grad_batches: int | None = None
    """The batches whose gradients added up before each optimizer step, as the run's set-up says (``None``: not
    known, or an older report)."""

    @property
    def on_cuda(self) -> bool:
        """Whether the run trained on a CUDA device."""
        return self.device.type == "cuda"
