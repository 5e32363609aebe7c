"""Inplace activations: out-of-place activations that save their input while a later op saves their output.

Only activations whose inplace variant saves just its result count (``TrainingSetup.inplace_keeps_result``:
LeakyReLU, ELU...); a ReLU saves its output already, so inplace it frees no saved memory, only a transient copy
that the counts cannot show at the peak: it is not advised, but it is replayed, so the report can answer it with
the replay's figure. The saving is the replayed one where the simulation made these modules inplace (a replay that
raised means no advice), else the saved inputs merged.
"""

from __future__ import annotations

from lightning_vram.advice.checkpoint_code import CodeContext, code_path
from lightning_vram.advice.rules.base import Rule, attributed_peak, replayed_reason, share_text
from lightning_vram.advice.savings import Discarded, Modelled, Saving, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    InplaceChange,
    ModuleProfile,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    StepChange,
    TrainingSetup,
)
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.INPLACE_ACTIVATIONS
INPLACE_MIN_SHARE = 0.02
"""Inplace activations save one saved tensor each: small, but free; advise it from 2% of the peak."""


RECOMPUTED_FROM_RESULT = frozenset({"ELU", "SELU", "CELU"})
"""Activations whose inplace gradient recovers the exponential from the result (``result + alpha``): the same
gradient up to float32 rounding, not bit for bit (LeakyReLU's is the same arithmetic)."""


def _numerics(types: list[str]) -> str:
    """What inplace changes in training for activation classes ``types``: nothing, or the gradient's rounding.

    >>> _numerics(["LeakyReLU"])
    'Training is unchanged: the same gradients, bit for bit.'
    """
    rounded = [name for name in types if name in RECOMPUTED_FROM_RESULT]
    if not rounded:
        return "Training is unchanged: the same gradients, bit for bit."
    return (
        f"{', '.join(rounded)} inplace {'computes its' if len(rounded) == 1 else 'compute their'} gradient from"
        " the result (the exponential recovered as result + alpha): the same gradient up to float32 rounding"
        " (about 1e-6 relative), not bit for bit; the forward pass is unchanged."
    )


def _read_again(saving: Saving) -> str:
    """Whether an input is read again after its activation (a residual connection reads it), as the advice knows it.

    The replay watches every op after each activation (a change whose input is read again is refused, so never
    advised); without a replay it cannot be told from measurements.
    """
    if saving.basis is SavingBasis.SIMULATED:
        return (
            "and the replay of this step saw no op read these inputs again after the activation (as a residual"
            " connection would): inplace computes what out of place does."
        )
    return (
        "but whether an input is used again later, as in a residual connection, cannot be told from measurements"
        " (the replay did not run): check that first."
    )


def _is_activation(profile: ModuleProfile) -> bool:
    return profile.inplace is False and "Dropout" not in profile.type


def _inplace_profiles(summary: RunSummary, setup: TrainingSetup) -> list[ModuleProfile]:
    """Out-of-place activations whose inplace variant would merge their saved input with their saved output."""
    merging = set(setup.inplace_keeps_result)
    return [
        profile
        for profile in summary.modules
        if _is_activation(profile)
        and profile.name in merging
        and profile.input_saved_bytes > 0
        and profile.output_saved_for_backward
    ]


def inplace_candidates(summary: RunSummary, setup: TrainingSetup) -> tuple[str, ...]:
    """The modules inplace-activations would name: safe for autograd (no earlier op saved their input)."""
    return tuple(profile.name for profile in _inplace_profiles(summary, setup) if not profile.input_saved_for_backward)


def output_savers(summary: RunSummary, setup: TrainingSetup) -> tuple[str, ...]:
    """Out-of-place activations that save their output already (ReLU): inplace, they merge no saved tensor.

    Only those safe for autograd (no earlier op saved their input); replayed so the report answers them.
    """
    return tuple(
        profile.name
        for profile in summary.modules
        if _is_activation(profile)
        and profile.output_saved_bytes > 0
        and profile.input_saved_bytes == 0
        and not profile.input_saved_for_backward
    )


def changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """The candidate modules made inplace, together, and apart those that save their output already."""
    found = (inplace_candidates(summary, setup), output_savers(summary, setup))
    return tuple(InplaceChange(modules) for modules in found if modules)


def inplace_activations(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """Out-of-place activations that save their input while a later op saves their output: inplace, one tensor."""
    attributed = attributed_peak(summary)
    if attributed is None:
        return None
    peak, _ = attributed
    candidates = _inplace_profiles(summary, setup)
    safe = [profile for profile in candidates if not profile.input_saved_for_backward]
    if not safe:
        return None
    merged = sum(profile.input_saved_bytes for profile in safe)
    modelled = Modelled(merged, peak.peak_bytes, "saving modelled: the saved inputs merged (not replayed)")
    saving = resolve_saving(simulation, InplaceChange(tuple(profile.name for profile in safe)), modelled, peak)
    if not isinstance(saving, Saving) or not saving.at_least(INPLACE_MIN_SHARE):
        return None
    unsafe = [profile.name for profile in candidates if profile.input_saved_for_backward]
    types = sorted({profile.type for profile in safe})
    largest = max(safe, key=lambda profile: profile.input_saved_bytes)
    evidence = (
        f"{len(safe)} activation module(s) run out of place ({', '.join(types)}), each saving its input for"
        f" backward while a later op saves its output: {format_bytes(merged)} of saved inputs,"
        f" {share_text(merged, peak.peak_bytes)} of the peak (largest {largest.name},"
        f" {format_bytes(largest.input_saved_bytes)}); {saving.evidence}"
    )
    if unsafe:
        evidence += f"; left out because autograd saved their input for an earlier op: {', '.join(unsafe[:5])}"
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=f"Use inplace activations (e.g. `{largest.type}(inplace=True)`) in {len(safe)} module(s)",
        detail=(
            "Out of place, these activations save their input for backward and the next op saves their output:"
            " two tensors. Inplace, they compute the gradient from their result, so one tensor serves both. This is"
            f" safe for autograd here (no earlier op saved these inputs), {_read_again(saving)}"
            f" {_numerics(types)}\n"
            f"```python\n{_code(safe, setup, largest.type)}\n```"
        ),
        evidence=evidence,
        estimated_saving_bytes=saving.saving_bytes,
        saving_basis=saving.basis,
        predicted_peak_bytes=saving.predicted_peak_bytes,
    )


WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""The names a wrapper gives the module it holds (FSDP1's, torch's checkpoint wrapper's, ``torch.compile``'s):
not in the model as built, where the printed lines go."""


def _as_built(name: str) -> str:
    """Module ``name`` as the model has it once built, before a strategy or ``torch.compile`` wrapped it.

    >>> _as_built("_fsdp_wrapped_module.network.1"), _as_built("network.1")
    ('network.1', 'network.1')
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def _code(safe: list[ModuleProfile], setup: TrainingSetup, example: str) -> str:
    """The lines making each of ``safe`` compute inplace, by name, and no other module.

    By class (``nn.ELU(inplace=True)``) the code named no module: a trial's CNN was advised 2 of its 3 ELUs, and an
    activation left out because an earlier op saved its input breaks backward made inplace. Setting ``inplace`` on
    the built module keeps its other arguments; a module the forward calls in several places changes in each.
    """
    context = CodeContext(setup.loop)
    keyed = {_as_built(name) for name in setup.keyed_containers}
    lines = [
        f"# {context.built('the model')}: these modules compute inplace (as `nn.{example}(inplace=True)`),",
        "# every other module as it is",
        *(f"{code_path(_as_built(profile.name), '', context.model, keyed)}.inplace = True" for profile in safe),
    ]
    return "\n".join(lines)


READ_LATER = "would train another model"
"""In the reason the replay gives for refusing an inplace change whose module's input is read again after it returns
(:func:`~lightning_vram.prediction.replay.inplace_reads.read_later_reason`)."""


def _read_later(simulation: Simulation | None, change: InplaceChange) -> bool:
    """Whether the replay refused ``change`` because an activation's input is read again after it (a residual)."""
    found = resolve_saving(simulation, change, modelled=None)
    return isinstance(found, Discarded) and READ_LATER in found.reason


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why inplace activations are not advised: they save their output already, free too little, or none qualifies.

    ``None`` where no module was profiled (no sampled step).
    """
    savers, candidates = output_savers(summary, setup), inplace_candidates(summary, setup)
    types = sorted({profile.type for profile in summary.modules if profile.name in savers})
    reasons = [
        replayed_reason(
            simulation,
            (InplaceChange(savers),),
            f"{', '.join(types)} {'saves' if len(types) == 1 else 'save'} its output already: inplace frees no saved"
            " tensor, at most its transient input",
        )
        if savers
        else None,
        replayed_reason(
            simulation,
            (InplaceChange(candidates),) if candidates else (),
            "inplace would change what the model computes"
            if candidates and _read_later(simulation, InplaceChange(candidates))
            else f"under the {format_percent(INPLACE_MIN_SHARE)} of the peak the rule needs",
        ),
    ]
    found = [reason for reason in reasons if reason is not None]
    if found:
        return "; ".join(found)
    if not summary.modules:
        return None
    unsafe = [profile.name for profile in _inplace_profiles(summary, setup) if profile.input_saved_for_backward]
    if unsafe:
        return (
            f"{', '.join(unsafe[:5])} run out of place, but autograd saved their input for an earlier op: inplace"
            " would break backward"
        )
    return "no activation module runs out of place saving a tensor that inplace would merge or free"


RULE = Rule(ID, inplace_activations, changes, why_not)
