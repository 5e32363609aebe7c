"""The FLOPs of a replayed step: torch's ``FlopCounterMode`` without its module tracker.

``FlopCounterMode`` counts through a dispatch mode (so it runs on fake tensors) and attributes each op to the modules
around it with a ``ModuleTracker``, which registers a gradient hook on every module's inputs and outputs; in
``"all"`` mode such a hook holds each gradient until its siblings arrive, so a replay counted with it held gradients
longer than training does (a checkpointed ResNet's backward peak rose by 28.6 KiB). The replay needs the step's
total only: :class:`StepFlops` counts every op into ``"Global"`` and registers no hook, leaving each figure of the
replay as it was.
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode


class _Everywhere:
    """A module tracker that tracks nothing: every op counts towards the step's total (``"Global"``) alone."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _Everywhere:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``FlopCounterMode`` leaves its tracker with no arguments."""


class StepFlops(FlopCounterMode):
    """``FlopCounterMode`` counting the step's total FLOPs without per-module hooks (:meth:`get_total_flops`)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _Everywhere()  # type: ignore[assignment]
