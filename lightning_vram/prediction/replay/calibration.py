"""The sampled step calibrates the replay: its allocator peaks beside the replay's, and what the replay cannot see.

:func:`calibrate` sets the replay of a sampled step against the allocator's readings of that step, phase by phase
(allocated and reserved peaks): the replay's error. What the allocator held beyond the replay in a phase (cuDNN's
convolution workspaces, cuBLASLt's, anything else fake tensors do not size; never negative) is that phase's unseen
bytes, and :func:`carry` adds them to every later replay of the run, so that a variant, a batch size or the fit
table stands on what the device really held rather than on what the replay could see.

One measurement cannot tell a fixed workspace (cuBLAS's) from one that grows with the batch (cuDNN's convolution
workspaces, sized by the convolution's input): at a larger batch the unseen bytes are carried in proportion to
the batch (:func:`unseen_at`: the run's figure times ``batch / run's batch``), at a smaller one as measured, so
that no batch is under-carried; a fixed workspace is over-carried at a larger batch, by its bytes times the
batches' ratio less one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from lightning_vram.records import Calibration, Phase, PhaseCalibration, PhasePeak, ReplayedStep, in_phase_order
from lightning_vram.units import format_bytes


def calibrate(replayed: ReplayedStep, measured: Mapping[Phase, PhasePeak], step: int) -> Calibration | None:
    """Each phase both the replay and the sampled step ``step`` have, measured against replayed (bytes).

    ``measured`` holds the allocator's peaks of the sampled step (``peak_bytes`` allocated, ``reserved_bytes`` the
    reserve at the phase's end); ``None`` when no phase is in both.
    """
    phases = tuple(
        PhaseCalibration(
            phase=phase,
            replayed_allocated_bytes=peak.peak_bytes,
            measured_allocated_bytes=measured[phase].peak_bytes,
            replayed_reserved_bytes=peak.reserved_bytes,
            measured_reserved_bytes=measured[phase].reserved_bytes,
        )
        for phase, peak in in_phase_order(replayed.phases)
        if phase in measured
    )
    return Calibration(step, phases) if phases else None


def carried_note(calibration: Calibration) -> str:
    """The note a carried prediction bears: how much was carried into which phase, and from which step.

    >>> from lightning_vram.records import Phase, PhaseCalibration
    >>> print(carried_note(Calibration(1, (PhaseCalibration(Phase.FORWARD, 0, 1024, None, None),))))
    measured beyond the replay on sampled step 1 and carried into this prediction: 1.0 KiB in forward
    """
    phases = calibration.phases
    parts = ", ".join(
        f"{format_bytes(phase.unseen_bytes)} in {phase.phase.value}" for phase in phases if phase.unseen_bytes
    )
    reserved = ", ".join(
        f"{format_bytes(phase.unseen_reserved_bytes)} in {phase.phase.value}"
        for phase in calibration.phases
        if phase.unseen_reserved_bytes
    )
    return (
        f"measured beyond the replay on sampled step {calibration.step} and carried into this prediction:"
        f" {parts or 'nothing allocated'}" + (f" (reserved: {reserved})" if reserved else "")
    )


def unseen_at(unseen: Mapping[Phase, int], run_batch: int | None, batch_size: int | None) -> dict[Phase, int]:
    """The unseen bytes per phase carried into a step of ``batch_size``, measured at ``run_batch``.

    Above the run's batch each phase's figure grows in proportion (rounded up to a byte), below it stays as
    measured: a workspace that grows with the batch is never under-carried. Unscaled where either batch is unknown.

    >>> unseen_at({Phase.FORWARD: 1000}, 8, 20), unseen_at({Phase.FORWARD: 1000}, 8, 4)
    ({<Phase.FORWARD: 'forward'>: 2500}, {<Phase.FORWARD: 'forward'>: 1000})
    """
    if run_batch is None or batch_size is None or batch_size <= run_batch or run_batch <= 0:
        return dict(unseen)
    return {phase: -(-value * batch_size // run_batch) for phase, value in unseen.items()}


def carry(step: ReplayedStep, calibration: Calibration, run_batch: int | None = None) -> ReplayedStep:
    """``step`` with each phase's unseen bytes added to its allocated peak (and unseen reserve to its reserved peak).

    ``run_batch``: the batch size the calibration was measured at; a step of a larger batch carries the unseen
    bytes in proportion (:func:`unseen_at`), and its reserved peak the growth too. A phase's ``other`` grows by what
    is added; a reserved peak stays at least its allocated peak. The timeline is left as replayed. Unchanged when
    nothing is carried.
    """
    if not calibration.carries:
        return step
    measured, unseen_reserved = calibration.unseen_bytes, calibration.unseen_reserved_bytes
    unseen = unseen_at(measured, run_batch, step.batch_size)
    phases = {}
    for phase, peak in step.phases.items():
        allocated = peak.peak_bytes + unseen.get(phase, 0)
        grown = unseen.get(phase, 0) - measured.get(phase, 0)
        reserved = peak.reserved_bytes
        if reserved is not None:
            reserved = max(reserved + unseen_reserved.get(phase, 0) + grown, allocated)
        breakdown = peak.breakdown.with_measured_peak(allocated) if peak.breakdown is not None else None
        phases[phase] = replace(peak, peak_bytes=allocated, reserved_bytes=reserved, breakdown=breakdown)
    note = carried_note(calibration)
    if unseen != measured:
        note += f" (scaled to batch {step.batch_size} from the run's {run_batch})"
    return replace(step, phases=phases, notes=(*step.notes, note))
