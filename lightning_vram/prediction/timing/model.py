"""A replayed step's time on a device: a roofline per op, plus each op's cost, plus a strategy's communication.

Each op the replay counted (:class:`~lightning_vram.records.work.StepWork`) takes
``max(flops / (peak * achieved), bytes / (bandwidth * achieved)) + overhead``: the slower of its arithmetic at the
achieved share of the device's peak FLOP/s for its dtype and its memory traffic at the achieved share of the
bandwidth, then the seconds an op adds (launch, dispatch). Assumed: ops run one after another (no overlap of one op
with the next, as in eager PyTorch on one stream); an op's bytes are its inputs read once and its outputs written
once (caches that serve a re-read input make memory-bound ops faster than this); an op without a FLOP formula in
torch (elementwise, reductions, copies) is memory-bound. Inside a training run the measured step time over the
prediction of the sampled step is a factor (:func:`calibrated`) that carries to the same run's variants.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_vram.prediction.timing.links import Link, communication_seconds
from lightning_vram.prediction.timing.peaks import DevicePeaks
from lightning_vram.records import ReplayedStep, StepTime, StepWork


def predict_step_time(
    step: ReplayedStep,
    device: DevicePeaks,
    communication_bytes: int = 0,
    link: Link | None = None,
    *,
    achieved: float | None = None,
    tf32: bool = False,
    sequence_length: int | None = None,
    calibration: float = 1.0,
) -> StepTime:
    """The time ``step`` takes on ``device``, in seconds, with its parts.

    Args:
        step: a replayed step with its ops counted (``Predictor.replay(change, count_flops=True)``); a checkpointed
            step's recomputation is in it, and its share is :attr:`~lightning_vram.records.StepTime.recompute_seconds`.
        device: the device's peaks (:data:`~lightning_vram.prediction.timing.peaks.GPU_PEAKS`,
            :func:`~lightning_vram.prediction.timing.host.measure_host_peaks`).
        communication_bytes: what one rank sends each step under a multi-GPU strategy (0: one device).
        link: the link those bytes cross; required with ``communication_bytes``.
        achieved: the share of the peaks reached, 0 to 1 (``None``: the device's own, ``device.achieved``).
        tf32: fp32 matrix products run in TF32 (``torch.backends.cuda.matmul.allow_tf32``).
        sequence_length: the tokens in each sample, for tokens per second (``None``: not a sequence batch).
        calibration: measured over predicted, from the run's own step (:func:`calibrated`); 1.0: none.

    Raises:
        ValueError: ``step`` was replayed without counting its ops, or an argument is out of its range.
    """
    work = step.work
    if work is None:
        raise ValueError("step must be replayed with its ops counted (Predictor.replay(..., count_flops=True))")
    share = device.achieved if achieved is None else achieved
    if not 0 < share <= 1:
        raise ValueError(f"achieved must be a share of peak in (0, 1], got {share!r}")
    if communication_bytes and link is None:
        raise ValueError(f"link must be given with communication_bytes, got link=None and {communication_bytes} bytes")
    if sequence_length is not None and sequence_length < 1:
        raise ValueError(f"sequence_length must be an int >= 1 or None, got {sequence_length!r}")
    if not calibration > 0:
        raise ValueError(f"calibration must be a factor > 0, got {calibration!r}")
    compute, memory, overhead = _seconds(work, device, share, tf32)
    recompute = sum(_seconds(work.recomputed(), device, share, tf32))
    communication = communication_seconds(communication_bytes, link) if link is not None else 0.0
    samples = step.batch_size
    basis = (
        f"roofline per op on {device.name}: max(FLOPs / ({share:.0%} of peak FLOP/s), bytes / ({share:.0%} of"
        f" {device.bandwidth / 1e9:,.1f} GB/s)) + {1e6 * device.op_overhead_seconds:.1f} us an op, over"
        f" {work.ops} ops, {work.flops / 1e9:,.2f} GFLOP, {work.bytes_moved / 1e9:,.3f} GB moved;"
        f" peaks: {device.source}"
    )
    if link is not None:
        basis += f"; communication: {communication_bytes:,} bytes a rank over {link.name}, not overlapped"
    return StepTime(
        device=device.name,
        compute_seconds=compute,
        memory_seconds=memory,
        overhead_seconds=overhead,
        communication_seconds=communication,
        recompute_seconds=recompute,
        achieved=share,
        basis=basis,
        calibration=calibration,
        samples=samples,
        tokens=samples * sequence_length if samples is not None and sequence_length is not None else None,
    )


def _seconds(work: StepWork, device: DevicePeaks, share: float, tf32: bool) -> tuple[float, float, float]:
    """(compute-bound, memory-bound, overhead) seconds of ``work``'s ops on ``device`` at ``share`` of its peaks.

    An op of a kind whose share the device measured (``DevicePeaks.op_achieved``) takes that share instead.
    """
    compute = memory = 0.0
    for group in work.groups:
        measured = device.achieved_for(group.op)
        op_share = share if measured is None else measured
        arithmetic = group.flops / (device.flops_per_second(group.dtype, tf32) * op_share)
        traffic = group.bytes_moved / (device.bandwidth * op_share)
        if arithmetic >= traffic:
            compute += arithmetic * group.count
        else:
            memory += traffic * group.count
    return compute, memory, device.op_overhead_seconds * work.ops


def calibrated(predicted: StepTime, measured_seconds: float) -> StepTime:
    """``predicted`` scaled so that its seconds are ``measured_seconds``: the run's own step calibrates it.

    Its :attr:`~lightning_vram.records.StepTime.calibration` is the factor; a variant of the same run predicted with
    ``calibration=`` that factor carries it.

    >>> from lightning_vram.records import StepTime
    >>> step = StepTime("cpu", 0.010, 0.005, 0.005, 0.0, 0.0, 1.0, "")
    >>> calibrated(step, 0.030).calibration
    1.5
    """
    if not measured_seconds > 0:
        raise ValueError(f"measured_seconds must be a number of seconds > 0, got {measured_seconds!r}")
    uncalibrated = predicted.seconds / predicted.calibration
    if uncalibrated <= 0:
        raise ValueError("predicted step time is 0 seconds: nothing to calibrate")
    return replace(predicted, calibration=measured_seconds / uncalibrated)
