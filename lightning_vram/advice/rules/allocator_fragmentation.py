"""Allocator fragmentation: the allocator reserves far more than the peak allocation, or had to retry."""

from __future__ import annotations

from lightning_vram.advice.rules.base import Rule, no_changes, share_text
from lightning_vram.records import Advice, AdviceId, RunSummary, SavingBasis, Severity, Simulation, TrainingSetup
from lightning_vram.units import MIB, format_bytes

ID = AdviceId.ALLOCATOR_FRAGMENTATION
FRAGMENTATION_SHARE = 0.25
"""Cached-but-unused memory above this share of the reserve at the peak suggests fragmentation..."""
FRAGMENTATION_MIN_BYTES = 256 * MIB
"""...when it is also this large in absolute terms."""


def allocator_fragmentation(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """The allocator reserves far more than the peak allocation, or had to retry allocations."""
    peak = summary.peak
    if not summary.on_cuda or peak is None or peak.reserved_bytes is None:
        return None
    cached = max(peak.reserved_bytes - peak.peak_bytes, 0)
    retries = summary.alloc_retries or 0
    fragmented = cached >= FRAGMENTATION_SHARE * peak.reserved_bytes and cached >= FRAGMENTATION_MIN_BYTES
    if not fragmented and retries == 0:
        return None
    return Advice(
        id=ID,
        severity=Severity.WARNING,
        title="Let the allocator grow segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        detail=(
            "The caching allocator keeps freed blocks; when sizes vary, blocks cannot be reused and the reserve"
            " grows beyond what tensors need. Expandable segments map memory as needed instead.\n"
            "```bash\nPYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py\n```"
        ),
        evidence=(
            f"reserved {format_bytes(peak.reserved_bytes)} at the peak while {format_bytes(peak.peak_bytes)} were"
            f" allocated ({format_bytes(cached)} cached, {share_text(cached, peak.reserved_bytes)} of the reserve);"
            f" {retries} allocation retries"
        ),
        estimated_saving_bytes=cached,
        saving_basis=SavingBasis.MODELLED,
    )


RULE = Rule(ID, allocator_fragmentation, no_changes)
