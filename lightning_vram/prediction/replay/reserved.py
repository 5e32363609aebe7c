"""The reserved memory of a replayed step: a model of the CUDA caching allocator driven by the replay, per phase.

:class:`ReservedPeaks` takes the replay's allocation sequence (an
:class:`~lightning_vram.prediction.replay.live.AllocationListener`, cuBLAS's workspaces included, with the phases'
starts) and runs it through a :class:`~lightning_vram.prediction.allocator.model.CachingAllocatorModel`, reading the
model's reserved peak as each phase ends, before the phase boundary resets the peaks (as the monitor reads torch's
counters on a sampled step). The replayed step runs after the run's first step, synthesised from it
(:mod:`~lightning_vram.prediction.replay.history`): the cache a steady step finds is the one the first step left.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from lightning_vram.prediction.allocator.model import CachingAllocatorModel
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.history import with_first_step
from lightning_vram.records import AllocationEvent, AllocationSequence, Phase


def run_settings(environ: Mapping[str, str] | None = None) -> AllocatorSettings | str:
    """The caching allocator's settings the run has (``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``).

    Or why its reserved memory is not simulated: a configuration torch would refuse, or CUDA's own allocator
    (``backend:cudaMallocAsync``), which the model does not follow.

    >>> run_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).conf()
    'expandable_segments:True'
    >>> print(run_settings({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}))
    reserved memory not simulated: backend:cudaMallocAsync is CUDA's own allocator, which the model does not follow
    """
    try:
        settings = AllocatorSettings.from_environment(os.environ if environ is None else environ)
    except ValueError as error:
        return f"reserved memory not simulated: {error}"
    if settings.backend != "native":
        return (
            f"reserved memory not simulated: backend:{settings.backend} is CUDA's own allocator, which the model does"
            " not follow"
        )
    return settings


HISTORY_STEPS = 2
"""The steps run before the replayed one: the first, synthesised, then one as the replayed step runs, so that the
replayed step is the run's step 2, the monitor's first sampled step (``attribution_start_step``): its forward pass
starts with the whole reserve of the step before, as from then on."""


class ReservedPeaks:
    """A replay's allocation sequence, run through a caching allocator's model: each phase's reserved peak, bytes.

    An allocation listener (``malloc``, ``free``, ``reset_peaks``) and a sampler of the replay (``start_phase`` marks
    where each phase starts: its peaks restart there). The sequence is kept until :meth:`finish`, which runs it as a
    steady step holds it: after the run's first step, synthesised from it, and a second (:data:`HISTORY_STEPS`; see
    :func:`~lightning_vram.prediction.replay.history.with_first_step`), with the blocks :meth:`starts_with` names
    as the step's gradients and optimizer state; the library workspaces (negative blocks, allocated at a thread's
    first matmul and kept for the process) are allocated where the first step first used them.
    """

    def __init__(self, settings: AllocatorSettings) -> None:
        self.settings = settings
        self._events: list[AllocationEvent] = []
        self._gradients: dict[int, int] = {}
        self._optimizer_state: tuple[int, ...] = ()
        self._steps_before = HISTORY_STEPS

    def malloc(self, block: int, size: int, stream: int = 0) -> None:
        """``block`` (``size`` bytes as requested) is allocated on ``stream``."""
        self._events.append(("malloc", block, size, stream))

    def free(self, block: int) -> None:
        """``block`` is freed."""
        self._events.append(("free", block, 0, 0))

    def reset_peaks(self) -> None:
        """A phase starts (already marked by :meth:`start_phase`, which the replay calls first)."""

    def start_phase(self, phase: Phase) -> None:
        """``phase`` starts: the peaks restart here."""
        self._events.append(phase)

    def sample(self, op: str) -> None:
        """An op ran: nothing to note (its allocations came as ``malloc`` and ``free``)."""

    def starts_with(self, gradients: Mapping[int, int], optimizer_state: Sequence[int], first: bool = False) -> None:
        """What the step's starting blocks are, for the first step before it.

        ``gradients``: each gradient block the step starts with, mapped to the block that holds the same parameter's
        gradient at its end. ``optimizer_state``: the optimizer state's blocks, in the order the optimizer made them.
        ``first``: the step is the run's first itself (it made the optimizer state: a module that has not trained,
        replayed without a warm-up): nothing runs before it, the workspaces are allocated where it first used them.
        Not called: the first step starts with every block the steady step starts with.
        """
        self._gradients = dict(gradients)
        self._optimizer_state = tuple(optimizer_state)
        self._steps_before = 0 if first else HISTORY_STEPS

    def sequence(self) -> AllocationSequence:
        """The sequence so far as a steady step makes it: the run's first steps (:data:`HISTORY_STEPS`), then it."""
        return with_first_step(tuple(self._events), self._gradients, self._optimizer_state, self._steps_before)

    def finish(self, settings: AllocatorSettings | None = None, steps_before: int | None = None) -> dict[Phase, int]:
        """The sequence so far through a fresh model: every phase's reserved peak, bytes.

        ``settings``: the allocator's (default: those given at construction), so that one sequence answers what
        another setting would have reserved. ``steps_before``: the run's steps before the replayed one, at most
        :data:`HISTORY_STEPS` (default: that many, none for a step that is the run's first): the reserve a step
        sampled earlier finds (a sampled step 1's forward starts with the first step's reserve only; measured on an
        H100, GPT-2 124M's 8,946 MiB at step 1 against 9,732 MiB from step 2 on).
        """
        steps = self._steps_before if steps_before is None else min(steps_before, self._steps_before)
        sequence = with_first_step(tuple(self._events), self._gradients, self._optimizer_state, steps)
        return phase_peaks(sequence, settings or self.settings)


def phase_peaks(sequence: AllocationSequence, settings: AllocatorSettings) -> dict[Phase, int]:
    """``sequence`` (as :meth:`ReservedPeaks.sequence` makes it) through a fresh model: each phase's reserved peak.

    The highest of the phase's segments, bytes (a phase met in the first step and in the step: the step's, where the
    allocator releases nothing).
    """
    model = CachingAllocatorModel(settings)
    peaks: dict[Phase, int] = {}
    phase: Phase | None = None
    for event in sequence:
        if isinstance(event, Phase):
            if phase is not None:
                peaks[phase] = max(peaks.get(phase, 0), model.peak_reserved_bytes)
            phase = event
            model.reset_peaks()
        elif event[0] == "malloc":
            model.malloc(event[1], event[2], event[3])
        else:
            model.free(event[1])
    if phase is not None:
        peaks[phase] = max(peaks.get(phase, 0), model.peak_reserved_bytes)
    return peaks
