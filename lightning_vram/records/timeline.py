"""Memory during one replayed step, op by op: live bytes by part, bounded in size however long the step.

A replay samples, after each op, every live byte on the counted device split into the counted parts (parameters,
gradients, optimizer state, saved activations) and ``other`` (temporaries and whatever else is alive: the live
total beyond the counted parts). A long step keeps at most a bounded number of points, each the highest of a window
of consecutive ops, so that the step's peak is always one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_vram.records.measured import Phase


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Live bytes after op number ``op`` (counted from 0 at the step's start) of ``phase``, by part."""

    op: int
    phase: Phase
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    other: int

    @property
    def total(self) -> int:
        """Every live byte at this point: the parts' sum."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.other


@dataclass(frozen=True)
class StepTimeline:
    """Live bytes over one replayed step, by part; its highest point and what ran at it.

    ``points``: in op order, at most a bounded number (each the highest of its window of ops); ``ops``: the ops the
    step ran; ``phase_starts``: the op number at which each phase began, in step order (exact, whatever the
    windows); ``peak_index``: the index in ``points`` of the highest point (the first on a tie); ``peak_module``: the
    module whose forward ran at the peak (``None`` outside any module, as in most of backward); ``peak_op``: the op
    that ran last at the peak (``convolution``: no namespace, no overload). ``module_entries``: each module whose
    forward ran in the forward phase, with the number of the first op run inside it (its own or a submodule's), in
    that order: the replay's own, for ZeRO-3's arithmetic (what DeepSpeed has gathered by then); not written to JSON
    and not compared.
    """

    points: tuple[TimelinePoint, ...]
    ops: int
    phase_starts: tuple[tuple[Phase, int], ...]
    peak_index: int
    peak_module: str | None
    peak_op: str | None
    module_entries: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def peak(self) -> TimelinePoint:
        """The highest point."""
        return self.points[self.peak_index]
