"""A memory budget's checkpointing plan (:class:`BudgetPlan`): what to checkpoint so that a step fits, and its cost.

``predict(module, batch, memory_budget=...)`` asks for it; :mod:`lightning_vram.advice.budget` chooses it by replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_vram.records.advice import CheckpointPlan
from lightning_vram.units import format_bytes, format_percent


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
    ``basis``: how the peak is measured (``"live peak"`` or ``"reserved (simulated allocator)"``).
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

    @property
    def recomputed_share(self) -> float | None:
        """The recomputation's FLOPs over the baseline step's (``None`` where either was not counted)."""
        if self.recomputed_flops is None or not self.step_flops:
            return None
        return self.recomputed_flops / self.step_flops

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: bytes and FLOPs as numbers, the plan's units as lists of module names."""
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
        }

    def lines(self) -> list[str]:
        """A few lines for the prediction's table: the verdict, the plan, its cost and the code to write.

        Each peak names its figure: ``reserved`` (on CUDA the simulated allocator's, above the allocated peak the
        prediction's header gives by what it caches) or ``live``.
        """
        head = f"Memory budget {format_bytes(self.budget_bytes)} ({self.basis}):"
        if not self.fits:
            return [head, f"  no plan fits: {self.reason}"]
        if self.plan is None:
            return [head, f"  fits without checkpointing: {self.reason}"]
        share = self.recomputed_share
        cost = (
            f"{self.recomputed_flops:,} FLOPs recomputed ({format_percent(share)} of the step)"
            if self.recomputed_flops is not None and share is not None
            else "recomputation not counted"
        )
        figure = "reserved" if self.basis.startswith("reserved") else "live"
        code = [f"    {line}" for line in (self.code or "").splitlines()]
        return [
            head,
            f"  checkpoint {self.what}: {figure} peak {format_bytes(self.peak_bytes)} (from"
            f" {format_bytes(self.baseline_peak_bytes)} {figure}), {cost}",
            f"  {self.reason}; the code:" if code else f"  {self.reason}",
            *code,
        ]
