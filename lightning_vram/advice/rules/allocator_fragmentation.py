"""Allocator fragmentation: what ``expandable_segments:True`` returns on this run's own step, simulated.

Where the run's step was replayed on CUDA (its allocations and frees kept), the allocator's model runs that sequence
with the run's settings and with expandable segments; the saving is the difference of the two reserved peaks, advised
only when it is material (:data:`MATERIAL_SHARE`, :data:`MATERIAL_BYTES`), and never where the run already has
expandable segments. The measured signs (reserved far above allocated, allocation retries) are quoted as evidence.
Without such a replay, the measured signs alone trigger it, with a modelled saving (what is cached at the peak).
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import Rule, no_changes, share_text
from lightning_vram.records import (
    Advice,
    AdviceId,
    PhasePeak,
    RunSummary,
    SavingBasis,
    Severity,
    Simulation,
    TrainingSetup,
)
from lightning_vram.units import MIB, format_bytes

ID = AdviceId.ALLOCATOR_FRAGMENTATION
FRAGMENTATION_SHARE = 0.25
"""Without a simulation: cached-but-unused memory above this share of the reserve at the peak suggests
fragmentation..."""
FRAGMENTATION_MIN_BYTES = 256 * MIB
"""...when it is also this large in absolute terms."""
MATERIAL_SHARE = 0.05
"""Simulated: expandable segments must return at least this share of the simulated reserved peak... A smaller saving
is within what the reserve moves by from one batch shape to the next, not worth a restart with a new setting (on the
H200, GPT-2's reserve stood 11.6% above its allocated peak with torch's defaults, 0.6% with expandable segments)."""
MATERIAL_BYTES = 64 * MIB
"""...and at least this much: a few of the large pool's 20 MiB segments, below which no batch size changes."""
EXPANDABLE = "expandable_segments:True"

_TITLE = f"Let the allocator grow segments: PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}"
_DETAIL = (
    "The caching allocator keeps freed blocks; when sizes vary, blocks cannot be reused and the reserve grows beyond"
    " what tensors need. Expandable segments map memory as needed instead. This changes where memory is mapped,"
    " not what is computed: training is unchanged, bit for bit.\n"
    f"```bash\nPYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} python train.py\n```"
)


def _measured(peak: PhasePeak, reserved: int, retries: int) -> str:
    cached = max(reserved - peak.peak_bytes, 0)
    return (
        f"reserved {format_bytes(reserved)} at the peak while {format_bytes(peak.peak_bytes)} were allocated"
        f" ({format_bytes(cached)} cached, {share_text(cached, reserved)} of the reserve); {retries} allocation"
        " retries"
    )


def simulated_reserve(simulation: Simulation | None) -> tuple[int, int] | None:
    """The replayed step's reserved peak with the run's settings and with expandable segments, in bytes.

    Both are the replay's own sequence through the allocator's model (nothing carried from the measured step);
    ``None`` where they were not simulated (no trusted replay with reserved figures, or the run already expandable).
    """
    if simulation is None or simulation.skipped is not None or simulation.baseline is None:
        return None
    expandable = simulation.expandable_reserved_bytes
    if not expandable:
        return None
    calibration = simulation.calibration
    if calibration is not None:  # the baseline carries the measured excess: the replay's own reserve is here
        reserved = [phase.replayed_reserved_bytes for phase in calibration.phases]
    else:
        reserved = [peak.reserved_bytes for peak in simulation.baseline.phases.values()]
    known = [value for value in reserved if value is not None]
    return (max(known), max(expandable.values())) if known else None


def allocator_fragmentation(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """Expandable segments return a material part of the simulated reserve; or, unsimulated, the measured signs."""
    peak = summary.peak
    if not summary.on_cuda or peak is None or peak.reserved_bytes is None:
        return None
    conf = simulation.allocator_conf if simulation is not None else None
    if conf is not None and EXPANDABLE in conf:
        return None
    retries = summary.alloc_retries or 0
    measured = _measured(peak, peak.reserved_bytes, retries)
    simulated = simulated_reserve(simulation)
    if simulated is not None:
        reserve, expandable = simulated
        saving = reserve - expandable
        if saving < max(MATERIAL_SHARE * reserve, MATERIAL_BYTES):
            return None
        return Advice(
            id=ID,
            severity=Severity.WARNING,
            title=_TITLE,
            detail=_DETAIL,
            evidence=(
                f"simulated on this run's own step, the caching allocator reserves {format_bytes(reserve)} with the"
                f" run's settings ({conf or 'torch defaults'}) and {format_bytes(expandable)} with {EXPANDABLE}"
                f" ({format_bytes(saving)} less); measured: {measured}"
            ),
            estimated_saving_bytes=saving,
            saving_basis=SavingBasis.SIMULATED,
        )
    cached = max(peak.reserved_bytes - peak.peak_bytes, 0)
    fragmented = cached >= FRAGMENTATION_SHARE * peak.reserved_bytes and cached >= FRAGMENTATION_MIN_BYTES
    if not fragmented and retries == 0:
        return None
    return Advice(
        id=ID,
        severity=Severity.WARNING,
        title=_TITLE,
        detail=_DETAIL,
        evidence=measured,
        estimated_saving_bytes=cached,
        saving_basis=SavingBasis.MODELLED,
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why expandable segments are not advised: the run has them, the simulated saving is small, or nothing is cached.

    ``None`` off CUDA or where the reserved memory was not measured.
    """
    peak = summary.peak
    if not summary.on_cuda or peak is None or peak.reserved_bytes is None:
        return None
    conf = simulation.allocator_conf if simulation is not None else None
    if conf is not None and EXPANDABLE in conf:
        return f"the run sets {EXPANDABLE} already"
    measured = _measured(peak, peak.reserved_bytes, summary.alloc_retries or 0)
    simulated = simulated_reserve(simulation)
    if simulated is not None:
        reserve, expandable = simulated
        return (
            f"simulated on this run's own step, {EXPANDABLE} reserves {format_bytes(expandable)} instead of"
            f" {format_bytes(reserve)}: under the {MATERIAL_SHARE:.0%} and {format_bytes(MATERIAL_BYTES)} the rule"
            f" needs (measured: {measured})"
        )
    return (
        f"{measured}: under the {FRAGMENTATION_SHARE:.0%} and {format_bytes(FRAGMENTATION_MIN_BYTES)} cached, and no"
        " retries, the rule needs"
    )


RULE = Rule(ID, allocator_fragmentation, no_changes, why_not)
