"""Whether the CUDA caching allocator serves a replayed step at a device's memory: what "fits" means on CUDA.

A replayed step keeps its allocation sequence (:attr:`~lightning_vram.records.ReplayedStep.allocations`); it runs
through a :class:`~lightning_vram.prediction.allocator.model.CachingAllocatorModel` capped at the memory the
allocator may hold (the device's free memory at the start, less what is outside the allocator: the CUDA context,
NCCL's buffers). The step fits when every request is served, the allocator's release-and-retry included; where one
is not, :class:`Shortfall` says in which phase and what was asked for.

What the replay cannot see (measured by the calibration: bytes per phase) is held as one more block for the whole
of each phase, allocated as the phase starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_vram.prediction.allocator.model import CachingAllocatorModel, SimulatedOutOfMemory
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.records import AllocationSequence, Phase, ReplayedStep

UNSEEN_BLOCK = -(1 << 40)
"""The block id of a phase's unseen bytes (workspaces take small negative ids, storages positive ones)."""


@dataclass(frozen=True)
class Shortfall:
    """The request the simulated allocator could not serve, bytes.

    ``phase``: where it came (``None``: before the step's first phase). ``requested_bytes``: the size asked for;
    ``allocation_bytes``: the device memory the allocator asked for (torch's "Tried to allocate");
    ``allocated_bytes`` and ``reserved_bytes``: the allocator then, after releasing its cache.
    """

    phase: Phase | None
    requested_bytes: int
    allocation_bytes: int
    allocated_bytes: int
    reserved_bytes: int

    @property
    def text(self) -> str:
        """One line: where and what."""
        where = f"in {self.phase.value}" if self.phase is not None else "before the step"
        return (
            f"{where}: {self.allocation_bytes:,} B asked for with {self.allocated_bytes:,} B allocated and"
            f" {self.reserved_bytes:,} B reserved"
        )


@dataclass(frozen=True)
class Serving:
    """The step run through the allocator's model at ``capacity_bytes``.

    ``reserved_peak_bytes``: the most the allocator held (up to the failure, when there is one); ``shortfall``:
    the request it could not serve (``None``: it served the whole step).
    """

    capacity_bytes: int
    reserved_peak_bytes: int
    shortfall: Shortfall | None

    @property
    def served(self) -> bool:
        """Whether the whole step was served."""
        return self.shortfall is None


def serve(
    allocations: AllocationSequence,
    settings: AllocatorSettings,
    capacity_bytes: int,
    unseen_bytes: Mapping[Phase, int] | None = None,
) -> Serving:
    """Run ``allocations`` through the allocator's model capped at ``capacity_bytes`` (bytes the allocator may hold).

    ``unseen_bytes``: per phase, bytes the replay cannot see, held through the phase (``None``: none).

    >>> from lightning_vram.records import Phase
    >>> step = (Phase.FORWARD, ("malloc", 1, 3 * 2**20, 0), ("malloc", 2, 19 * 2**20, 0))
    >>> serve(step, AllocatorSettings(), 40 * 2**20).served  # a 20 MiB segment, then one of 20 MiB: 40 MiB
    True
    >>> print(serve(step, AllocatorSettings(), 39 * 2**20).shortfall.text)
    in forward: 20,971,520 B asked for with 3,145,728 B allocated and 20,971,520 B reserved
    >>> serve(step, AllocatorSettings(), -2**20).served  # a device smaller than what is kept outside the allocator
    False
    """
    return _simulated(allocations, settings, capacity_bytes, unseen_bytes)[0]


def _simulated(
    allocations: AllocationSequence,
    settings: AllocatorSettings,
    capacity_bytes: int,
    unseen_bytes: Mapping[Phase, int] | None,
) -> tuple[Serving, bool]:
    """:func:`serve`, and whether the capacity never refused a request (:attr:`CachingAllocatorModel.refusals`)."""
    # A capacity of 0 or less (a device smaller than the CUDA context): the first request fails.
    model = CachingAllocatorModel(settings, max(capacity_bytes, 1))
    unseen = unseen_bytes or {}
    phase: Phase | None = None
    malloc, free = model.malloc, model.free  # bound once: this loop is the fit table search's hot path
    try:
        for event in allocations:
            if isinstance(event, Phase):
                if phase is not None and unseen.get(phase, 0) > 0:
                    free(UNSEEN_BLOCK)
                phase = event
                if unseen.get(phase, 0) > 0:
                    malloc(UNSEEN_BLOCK, unseen[phase])
            else:
                kind, block, size, stream = event
                if kind == "malloc":
                    malloc(block, size, stream)
                else:
                    free(block)
    except SimulatedOutOfMemory as error:
        shortfall = Shortfall(
            phase, error.requested_bytes, error.allocation_bytes, error.allocated_bytes, error.reserved_bytes
        )
        return Serving(capacity_bytes, model.peak_reserved_bytes, shortfall), False
    return Serving(capacity_bytes, model.peak_reserved_bytes, None), model.refusals == 0


_Unseen = tuple[tuple[Phase, int], ...]
"""A phase's unseen bytes as a memo's key: (phase, bytes) pairs, in order."""


class ServingMemo:
    """One search's servings of a step by batch size, each simulated once (bytes as :func:`serve`'s).

    The memo keys on the batch, not on its sequence: a batch's sequence must be the same at every call (the fit
    table's synthesized steps are). Without expandable segments, a step served with no request refused
    (:attr:`CachingAllocatorModel.refusals`) is served alike, with the same reserved peak, at any capacity at least
    that peak: there it is not simulated again.

    >>> memo, step = ServingMemo(), (("malloc", 1, 3 * 2**20, 0),)
    >>> memo.serve(8, step, AllocatorSettings(), 40 * 2**20, {}).reserved_peak_bytes, memo.simulations
    (20971520, 1)
    >>> memo.serve(8, step, AllocatorSettings(), 30 * 2**20, {}).capacity_bytes, memo.simulations  # at least 20 MiB
    (31457280, 1)
    >>> memo.serve(8, step, AllocatorSettings(), 10 * 2**20, {}).served, memo.simulations
    (False, 2)
    """

    def __init__(self) -> None:
        self._servings: dict[tuple[AllocatorSettings, int, _Unseen, int], Serving] = {}
        self._unrefused: dict[tuple[AllocatorSettings, int, _Unseen], int] = {}
        """The reserved peak of a batch's step served with no request refused (no expandable segments), by settings,
        batch and unseen bytes."""
        self.simulations = 0
        """Steps run through the allocator's model."""

    def serve(
        self,
        batch_size: int,
        allocations: AllocationSequence,
        settings: AllocatorSettings,
        capacity_bytes: int,
        unseen_bytes: Mapping[Phase, int],
    ) -> Serving:
        """:func:`serve` on ``allocations``, the step of ``batch_size``: simulated where no earlier serving answers."""
        unseen = tuple(sorted(unseen_bytes.items()))
        step, at_capacity = (settings, batch_size, unseen), (settings, batch_size, unseen, capacity_bytes)
        known = self._servings.get(at_capacity)
        if known is not None:
            return known
        peak = self._unrefused.get(step)
        if peak is not None and capacity_bytes >= peak:
            return Serving(capacity_bytes, peak, None)
        self.simulations += 1
        serving, unrefused = _simulated(allocations, settings, capacity_bytes, unseen_bytes)
        self._servings[at_capacity] = serving
        if unrefused and not settings.expandable_segments:
            self._unrefused[step] = serving.reserved_peak_bytes
        return serving


def serves_step(
    step: ReplayedStep,
    capacity_bytes: int,
    settings: AllocatorSettings | None = None,
    unseen_bytes: Mapping[Phase, int] | None = None,
) -> Serving | None:
    """:func:`serve` on a replayed step's kept sequence; ``None`` where it kept none (no allocator simulated).

    ``settings``: the allocator's (default: those the replay simulated its reserved peaks with).
    """
    if step.allocations is None or step.allocator is None:
        return None
    chosen = settings if settings is not None else AllocatorSettings.from_conf(step.allocator)
    return serve(step.allocations, chosen, capacity_bytes, unseen_bytes)
