"""What a replayed step asks of a device's arithmetic and memory bandwidth, and the step time predicted from it.

A replay counts, op by op, the floating-point operations (torch's formulas: matrix products, convolutions,
attention), the bytes the op moves (its tensor inputs read and outputs written, as a roofline's memory traffic) and
the ops themselves (each a kernel launch, or a dispatch that launches none for a view). Ops alike in all of these
are kept as one :class:`OpGroup` with a count, so a model of repeated layers keeps few groups. FLOPs and bytes are
integers; times are seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_vram.records.measured import Phase

DTYPE_CLASSES = ("fp32", "fp16", "bf16", "fp64", "other")
"""The dtype classes an op is counted under, by its first floating-point tensor input (``other``: none)."""


@dataclass(frozen=True)
class OpGroup:
    """``count`` ops of one phase that each did ``flops`` FLOPs and moved ``bytes_moved`` bytes, in ``dtype``.

    ``recomputed``: run again in backward by activation checkpointing. ``view``: an alias of its input (a view,
    a reshape that copies nothing), dispatched without a kernel: it moves no bytes. ``op``: the op's name, without
    namespace or overload (``convolution_backward``).
    """

    phase: Phase
    dtype: str
    flops: int
    bytes_moved: int
    count: int
    recomputed: bool = False
    view: bool = False
    op: str = ""


@dataclass(frozen=True)
class StepWork:
    """Every op of a replayed step, as groups of alike ops (:class:`OpGroup`)."""

    groups: tuple[OpGroup, ...]

    @property
    def flops(self) -> int:
        """The step's FLOPs (multiply-adds count 2)."""
        return sum(group.flops * group.count for group in self.groups)

    @property
    def bytes_moved(self) -> int:
        """Bytes every op read and wrote, summed over the step."""
        return sum(group.bytes_moved * group.count for group in self.groups)

    @property
    def ops(self) -> int:
        """Ops dispatched in the step, views included."""
        return sum(group.count for group in self.groups)

    @property
    def kernels(self) -> int:
        """Ops that launch a kernel (every op but views)."""
        return sum(group.count for group in self.groups if not group.view)

    def in_phase(self, phase: Phase) -> StepWork:
        """Only the ops of ``phase``."""
        return StepWork(tuple(group for group in self.groups if group.phase is phase))

    def recomputed(self) -> StepWork:
        """Only the ops activation checkpointing ran again in backward."""
        return StepWork(tuple(group for group in self.groups if group.recomputed))


OpKey = tuple[Phase, str, int, int, bool, bool, str]
"""One op as counted: ``(phase, dtype, flops, bytes_moved, recomputed, view, op)``, the fields of :class:`OpGroup`."""


def grouped(ops: Iterable[OpKey]) -> StepWork:
    """Ops gathered into groups of alike ones, in first-seen order."""
    counts: dict[OpKey, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return StepWork(
        tuple(
            OpGroup(phase, dtype, flops, moved, count, recomputed, view, name)
            for (phase, dtype, flops, moved, recomputed, view, name), count in counts.items()
        )
    )


@dataclass(frozen=True)
class StepTime:
    """A step's predicted duration on a device, in seconds, and what it is made of.

    ``compute_seconds``: the ops whose arithmetic bounds them, at the achieved share of the device's peak FLOP/s;
    ``memory_seconds``: the ops whose memory traffic bounds them, at the achieved share of its bandwidth;
    ``overhead_seconds``: each op's launch or dispatch cost; ``communication_seconds``: what a multi-GPU strategy
    sends each step, over its link, not overlapped. ``recompute_seconds`` is the part of the first three that
    activation checkpointing's recomputed forward takes (already in them, not added again). ``achieved`` is the
    share of peak assumed; ``calibration`` the factor measured over predicted applied to ``seconds`` (1.0: none);
    ``samples`` and ``tokens`` the step's batch (``None`` where not known), from which the throughputs come.
    """

    device: str
    compute_seconds: float
    memory_seconds: float
    overhead_seconds: float
    communication_seconds: float
    recompute_seconds: float
    achieved: float
    basis: str
    calibration: float = 1.0
    samples: int | None = None
    tokens: int | None = None

    @property
    def seconds(self) -> float:
        """The predicted step time: its parts summed, times the calibration."""
        parts = self.compute_seconds + self.memory_seconds + self.overhead_seconds + self.communication_seconds
        return parts * self.calibration

    @property
    def samples_per_second(self) -> float | None:
        """Samples a second at this step time (``None`` where the batch size is not known)."""
        return self.samples / self.seconds if self.samples is not None and self.seconds > 0 else None

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens a second (``None`` where the batch has no length)."""
        return self.tokens / self.seconds if self.tokens is not None and self.seconds > 0 else None

    def __str__(self) -> str:
        """One line: the time, its parts and the throughput."""
        parts = (
            f"compute {1000 * self.compute_seconds:.2f} ms, memory {1000 * self.memory_seconds:.2f} ms,"
            f" overhead {1000 * self.overhead_seconds:.2f} ms"
        )
        if self.communication_seconds:
            parts += f", communication {1000 * self.communication_seconds:.2f} ms"
        if self.recompute_seconds:
            parts += f" (recomputation {1000 * self.recompute_seconds:.2f} ms of it)"
        rate = ""
        if self.tokens_per_second is not None:
            rate = f", {self.tokens_per_second:,.0f} tokens/s"
        elif self.samples_per_second is not None:
            rate = f", {self.samples_per_second:,.1f} samples/s"
        calibrated = f", calibrated x{self.calibration:.2f}" if self.calibration != 1.0 else ""
        return f"{1000 * self.seconds:.2f} ms a step on {self.device} ({parts}{calibrated}){rate}"
