"""Mixed precision: 32-bit training on a CUDA GPU, advised for tensor cores and for the memory a replay shows.

Autocast does not halve activations (it saves 16-bit copies of the weights for backward and keeps normalisation,
softmax and the loss in float32), so no memory saving is promised unless the step was replayed in 16 bits and its
peak fell by :data:`~lightning_vram.advice.rules.base.MIN_SAVING_SHARE` or more. Otherwise the advice is for
speed, on devices with tensor cores (compute capability 7.0 or higher) only, and says what the replay found; a
replay that raised, or one whose peak would rise to near the device's capacity, means no advice.

Off CUDA it is never advised (:data:`NOT_ADVISED_OFF_CUDA` says why, beside the replayed figure in the report's
simulation table), and it is replayed only on the CPU, whose figure the report shows: a device the report cannot
speak of gets no replay.
"""

from __future__ import annotations

from lightning_vram.advice.catalogue import FULL_PRECISIONS, TENSOR_CORE_CAPABILITY, mixed_precision_for
from lightning_vram.advice.rules.base import (
    MIN_SAVING_SHARE,
    NEAR_CAPACITY_SHARE,
    Rule,
    attributed_peak,
    not_replayed,
    replayed_figure,
    replayed_reason,
)
from lightning_vram.advice.savings import Saving, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    PrecisionChange,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    StepChange,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.MIXED_PRECISION
AUTOCAST_MEMORY = (
    "Autocast does not halve activations: it saves 16-bit copies of the weights for backward and keeps"
    " normalisation, softmax and the loss in float32."
)
"""Why mixed precision promises no memory saving that a replay has not shown."""
NUMERICS = (
    "This changes the numerics: 16-bit results round differently, so losses and weights will not match a float32"
    " run bit for bit (validate the model)."
)
"""What mixed precision changes in training, said in the advice: unlike the memory-only rules, not the same model."""
REPLAYED_DEVICE_TYPES = frozenset({"cuda", "cpu"})
"""Devices whose run replays 16-bit mixed precision: CUDA, where it is advised, and the CPU, where the report says
beside the replayed figure why it is not."""
NOT_ADVISED_OFF_CUDA = (
    "not advised on the CPU: mixed precision is advised for CUDA GPUs (tensor cores, device memory); a CPU runs"
    " bfloat16 matmuls fast only with AVX-512 BF16 or AMX instructions"
)
"""Why a CPU run gets no mixed-precision advice, said beside the replayed figure (the simulation's table)."""


def precision_code(precision: str, loop: TrainingLoop) -> str:
    """The code that trains in ``precision`` (``bf16-mixed`` or ``16-mixed``) where ``loop`` trains the model.

    A Trainer's or Fabric's own argument; a plain loop's ``torch.autocast`` around the forward pass and the loss (with
    a ``GradScaler`` for ``16-mixed``, as Lightning's plugin scales the loss), and the session told the precision.

    >>> precision_code("bf16-mixed", TrainingLoop.LIGHTNING)
    'Trainer(precision="bf16-mixed")'
    >>> print(precision_code("bf16-mixed", TrainingLoop.FABRIC))
    Fabric(precision="bf16-mixed")  # and session.start(..., precision="bf16-mixed")
    """
    told = f'session.start(..., precision="{precision}")'
    if loop is TrainingLoop.LIGHTNING:
        return f'Trainer(precision="{precision}")'
    if loop is TrainingLoop.FABRIC:
        return f'Fabric(precision="{precision}")  # and {told}'
    dtype = "bfloat16" if precision == "bf16-mixed" else "float16"
    lines = [
        f"{told}  # the session replays the step as the loop runs it",
        "# in the loop: the forward pass and the loss under autocast, backward and the optimizer step outside it",
        f'with torch.autocast("cuda", dtype=torch.{dtype}):',
        "    loss = ...  # as before",
    ]
    if precision == "bf16-mixed":
        return "\n".join([*lines, "loss.backward()"])
    return "\n".join(
        [
            'scaler = torch.amp.GradScaler("cuda")  # once, before the loop: float16 gradients need loss scaling',
            *lines,
            "scaler.scale(loss).backward()",
            "scaler.step(optimizer)  # instead of optimizer.step()",
            "scaler.update()",
        ]
    )


def not_advised(device_type: str, change: StepChange) -> str | None:
    """Why ``change``, replayed on a ``device_type`` run, is not advised although the report shows its figure.

    >>> not_advised("cpu", PrecisionChange("bf16-mixed")) == NOT_ADVISED_OFF_CUDA
    True
    >>> not_advised("cuda", PrecisionChange("bf16-mixed")) is None
    True
    """
    return NOT_ADVISED_OFF_CUDA if isinstance(change, PrecisionChange) and device_type == "cpu" else None


def changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """The 16-bit mixed precision this device should train in, when the run trains in full precision.

    Replayed where the report can speak of it: on CUDA, to advise it; on the CPU, to say why it is not advised.
    """
    if setup.precision not in FULL_PRECISIONS or summary.device.type not in REPLAYED_DEVICE_TYPES:
        return ()
    return (PrecisionChange(mixed_precision_for(summary.device.type, summary.device.compute_capability)),)


def mixed_precision(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """32-bit training on a CUDA GPU: 16-bit matmuls on tensor cores, and the memory the replay shows it frees."""
    attributed = attributed_peak(summary)
    if not summary.on_cuda or setup.precision not in FULL_PRECISIONS or attributed is None:
        return None
    peak, breakdown = attributed
    capability = summary.device.compute_capability
    precision = mixed_precision_for(summary.device.type, capability)
    tensor_cores = capability is not None and capability >= TENSOR_CORE_CAPABILITY
    found = resolve_saving(simulation, PrecisionChange(precision), modelled=None, measured=peak)
    if found is not None and not isinstance(found, Saving):
        return None
    replay = found
    saving = replay.saving_bytes if replay is not None and replay.at_least(MIN_SAVING_SHARE) else None
    capacity = summary.device.total_bytes
    rises_near_capacity = (
        replay is not None
        and capacity is not None
        and replay.saving_bytes < 0
        and replay.predicted_peak_bytes is not None
        and replay.predicted_peak_bytes >= NEAR_CAPACITY_SHARE * capacity
    )
    if rises_near_capacity or (saving is None and not tensor_cores):
        return None
    capability_text = f"compute capability {capability[0]}.{capability[1]}" if capability else "compute capability n/a"
    reason = (
        "supports bfloat16, which needs no loss scaling"
        if precision == "bf16-mixed"
        else "has no fast bfloat16: use float16, whose small gradients underflow unless the loss is scaled;"
        ' Lightning\'s "16-mixed" scales it (a GradScaler): keep that scaler (hand-written autocast needs its own)'
    )
    if replay is not None:
        moved = f"{format_bytes(abs(replay.saving_bytes))} {'lower' if replay.saving_bytes >= 0 else 'higher'}"
        replayed = (
            f"replayed on this run's step in {precision}, the peak is {format_bytes(replay.predicted_peak_bytes)}"
            f" instead of {format_bytes(replay.peak_bytes)} ({moved})."
        )
        memory = (
            f"Memory is not the reason to change: {replayed} {AUTOCAST_MEMORY}"
            if saving is None
            else f"Memory: {replayed}"
        )
        evidence_tail = f"; {replay.evidence}"
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
        id=ID,
        severity=Severity.INFO,
        title=title,
        detail=(
            f"{summary.device.name} ({capability_text}) {reason}. Weights and optimizer state stay in float32;"
            f" matmuls and convolutions run in 16 bits{faster}. {NUMERICS} {memory}\n"
            f"```python\n{precision_code(precision, setup.loop)}\n```"
        ),
        evidence=(
            f"training in {setup.precision} on {summary.device.name} ({capability_text}"
            f"{': tensor cores' if tensor_cores else ''}); activations are {format_bytes(breakdown.activations)}"
            f" of the {format_bytes(peak.peak_bytes)} {peak.phase.value} peak{evidence_tail}"
        ),
        estimated_saving_bytes=saving,
        saving_basis=SavingBasis.SIMULATED if saving is not None else None,
        predicted_peak_bytes=replay.predicted_peak_bytes if replay is not None else None,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why the replayed 16-bit step is not advised: off CUDA, the device; on CUDA, no saving and no tensor cores."""
    if setup.precision not in FULL_PRECISIONS:
        return f'the run trains in precision="{setup.precision}" already'
    declared = changes(summary, setup)
    if not summary.on_cuda:
        figure = next((text for change in declared if (text := replayed_figure(simulation, change))), None)
        return f"{figure}: {NOT_ADVISED_OFF_CUDA}" if figure is not None else NOT_ADVISED_OFF_CUDA
    capability = summary.device.compute_capability
    tensor_cores = capability is not None and capability >= TENSOR_CORE_CAPABILITY
    found = resolve_saving(simulation, PrecisionChange(mixed_precision_for("cuda", capability)), modelled=None)
    if found is None and not tensor_cores:
        return (
            f"{not_replayed(simulation)}: no memory saving is shown, and no tensor cores (compute capability"
            f" {TENSOR_CORE_CAPABILITY[0]}.{TENSOR_CORE_CAPABILITY[1]} or higher) to speed it up"
        )
    if tensor_cores:
        why = "the replayed peak would rise to near the device's capacity"
    else:
        why = (
            f"under the {format_percent(MIN_SAVING_SHARE)} saving the rule needs, and no tensor cores"
            f" (compute capability {TENSOR_CORE_CAPABILITY[0]}.{TENSOR_CORE_CAPABILITY[1]} or higher) to speed it up"
        )
    return replayed_reason(simulation, declared, why)


RULE = Rule(ID, mixed_precision, changes, why_not)
