"""A memory budget's checkpointing plan (:class:`BudgetPlan`): what to checkpoint so that a step fits, and its cost.

``predict(module, batch, memory_budget=...)`` asks for it; :mod:`lightning_vram.advice.budget` chooses it by replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_vram.records.advice import CheckpointPlan
from lightning_vram.units import format_bytes, format_percent

RESERVED_LEGEND = (
    "reserved: what the caching allocator holds from the device, the figure the budget is met on; allocated: what"
    ' the step\'s tensors hold (a CPU run measures this as its live peak; `device_type="cpu"` budgets that instead)'
)
"""The line that tells a budget's two figures apart, under its head where the budget counts reserved memory."""


@dataclass(frozen=True)
class BudgetPlan:
    """The checkpointing plan with the least recomputation whose replayed step fits ``budget_bytes``.

    ``fits``: a plan (or no checkpointing at all, ``plan`` ``None``) was replayed at or under the budget.
    ``peak_bytes``: the chosen step's predicted peak (the CPU's live peak; on CUDA the simulated caching allocator's
    reserved peak, served within the budget); where nothing fits, the smallest peak a replayed plan reached.
    ``baseline_peak_bytes``: the step without checkpointing, measured the same way. ``recomputed_flops``: the FLOPs
    backward's recomputation adds (the plan's replayed step less the baseline's; ``None``: not counted), and
    ``step_flops`` the baseline step's. ``what`` / ``code``: the plan in words and the code to write (``None``
    without a plan). ``reason``: why this plan, or why nothing fits. ``replays``: replays the search ran.
    ``basis``: how the peak is measured (``"live peak"`` or ``"reserved, simulated caching allocator"``).
    ``allocated_peak_bytes`` / ``baseline_allocated_bytes``: the same steps' allocated peaks, what their tensors hold
    (the replay's live peak, on CUDA in the allocator's 512-byte blocks), which a reserved figure is printed beside;
    the same as ``peak_bytes`` / ``baseline_peak_bytes`` on the live basis (``None`` where not recorded).
    ``recompute_seconds``: the predicted time of the plan's recomputation a step, ``step_seconds`` the baseline
    step's, both on ``timed_on``'s peaks (a CPU measured, a GPU of the table; ``None``: not priced), uncalibrated.
    """

    budget_bytes: int
    fits: bool
    plan: CheckpointPlan | None
    peak_bytes: int | None
    baseline_peak_bytes: int
    recomputed_flops: int | None
    step_flops: int | None
    what: str | None
    code: str | None
    reason: str
    replays: int
    basis: str
    allocated_peak_bytes: int | None = None
    baseline_allocated_bytes: int | None = None
    recompute_seconds: float | None = None
    step_seconds: float | None = None
    timed_on: str | None = None

    @property
    def reserved(self) -> bool:
        """Whether ``peak_bytes`` is the simulated caching allocator's reserved figure (else a live peak)."""
        return self.basis.startswith("reserved")

    @property
    def recomputed_share(self) -> float | None:
        """The recomputation's FLOPs over the baseline step's (``None`` where either was not counted)."""
        if self.recomputed_flops is None or not self.step_flops:
            return None
        return self.recomputed_flops / self.step_flops

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: bytes and FLOPs as numbers, the plan's units as lists of module names.

        The plan's ``selective``: the units (by their first module) it checkpoints selectively.
        """
        plan = self.plan
        return {
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "plan": None
            if plan is None
            else {
                "container": plan.container,
                "units": [list(unit) for unit in plan.units],
                "forward_of": plan.forward_of,
                "selective": list(plan.selective),
            },
            "peak_bytes": self.peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "recomputed_flops": self.recomputed_flops,
            "step_flops": self.step_flops,
            "recomputed_share": self.recomputed_share,
            "what": self.what,
            "code": self.code,
            "reason": self.reason,
            "replays": self.replays,
            "basis": self.basis,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "baseline_allocated_bytes": self.baseline_allocated_bytes,
            "recompute_seconds": self.recompute_seconds,
            "step_seconds": self.step_seconds,
            "timed_on": self.timed_on,
        }

    def __str__(self) -> str:
        """The plan as ``print(prediction)`` shows it (:meth:`lines`), not the record's fields."""
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """A few lines for the prediction's table: the verdict, the plan, its cost and the code to write.

        Each peak names its figure: ``reserved`` (on CUDA the simulated allocator's, above the allocated peak by what
        it caches), always with the allocated one beside it and :data:`RESERVED_LEGEND` under the head, or ``live``.
        """
        head = [f"Memory budget {format_bytes(self.budget_bytes)} ({self.basis}):"]
        if self.reserved:
            head.append(f"  {RESERVED_LEGEND}")
        before = peak_text(self.reserved, self.baseline_peak_bytes, self.baseline_allocated_bytes)
        if not self.fits:
            return [*head, f"  no plan fits: {self.reason}; without checkpointing the step peaks at {before}"]
        if self.plan is None:
            return [*head, f"  fits without checkpointing: {self.reason}"]
        share = self.recomputed_share
        cost = (
            f"{self.recomputed_flops:,} FLOPs recomputed ({format_percent(share)} of the step)"
            if self.recomputed_flops is not None and share is not None
            else "recomputation not counted"
        )
        if self.recompute_seconds is not None and self.step_seconds:
            # selective checkpointing recomputes ops that count 0 FLOPs and still take time: the time comes first
            flops = "" if self.recomputed_flops is None else f"; {self.recomputed_flops:,} FLOPs"
            cost = (
                f"recomputation predicted to take {1000 * self.recompute_seconds:.2f} ms a step"
                f" (+{format_percent(self.recompute_seconds / self.step_seconds)} of the step's predicted"
                f" {1000 * self.step_seconds:.2f} ms on {self.timed_on}{flops})"
            )
        code = [f"    {line}" for line in (self.code or "").splitlines()]
        after = peak_text(self.reserved, self.peak_bytes, self.allocated_peak_bytes)
        return [
            *head,
            f"  checkpoint {self.what}: peak {after} (from {before}), {cost}",
            f"  {self.reason}; the code:" if code else f"  {self.reason}",
            *code,
        ]


def peak_text(reserved: bool, peak_bytes: int | None, allocated_bytes: int | None) -> str:
    """A budget's peak in words: a reserved figure with the allocated one beside it, or a live peak.

    >>> peak_text(True, 65011712, 47441380), peak_text(False, 47441380, 47441380)
    ('62.0 MiB reserved, 45.2 MiB allocated', '45.2 MiB live')
    """
    if not reserved:
        return f"{format_bytes(peak_bytes)} live"
    return f"{format_bytes(peak_bytes)} reserved, {format_bytes(allocated_bytes)} allocated"
