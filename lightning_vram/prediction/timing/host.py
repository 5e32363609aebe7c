"""The CPU of the machine, measured: matrix-product FLOP/s, copy bandwidth and the seconds each op of a step adds.

A CPU has no datasheet figure a step could be predicted from (its clocks, cores, vector units and the threads torch
uses all vary), so its :class:`~lightning_vram.prediction.timing.peaks.DevicePeaks` are measured, once per process
(about a second), with torch's own kernels and thread count: a matrix product in fp32, bf16 and fp16, a large
copy, and a tiny forward and backward whose ops do next to nothing (its time over its op count is the cost of an op
in a training step: dispatch, autograd's bookkeeping, the allocator). Each figure is the median of a few repeats,
so a machine busy with other work is measured as busy as it is.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_vram.prediction.replay._fake import TorchDispatchMode
from lightning_vram.prediction.timing.peaks import DevicePeaks

MATMUL_SIZE = 512
"""Rows (and columns) of the square matrices multiplied to measure FLOP/s."""
HALF_SIZE = 128
"""Rows of the fp16 product: a CPU without fp16 arithmetic runs it far slower, and its rate is flat in size."""
COPY_BYTES = 32 * 1024 * 1024
"""Bytes of the tensor copied to measure bandwidth (larger than a CPU's caches)."""
REPEATS = 7
"""Timed repeats of each measurement, after one untimed warm-up; the median is kept."""
TINY_STEPS = 50
"""Tiny forward-and-backward passes timed together, for the cost of one op."""


def _median_seconds(work: Callable[[], object], repeats: int = REPEATS) -> float:
    """The median wall-clock seconds of ``work`` over ``repeats`` runs, after one run not timed."""
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, size: int = MATMUL_SIZE) -> float:
    """FLOP/s of a square matrix product of ``size`` rows in ``dtype``."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(dtype)
    right = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(left, right, out=out))
    return 2 * size**3 / seconds


def _copy_bandwidth() -> float:
    """Bytes a second read and written by a copy of :data:`COPY_BYTES` (each byte counted read and written)."""
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    seconds = _median_seconds(lambda: target.copy_(source))
    return 2 * COPY_BYTES / seconds


# torch ships TorchDispatchMode without annotations.
class _OpCount(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _tiny_step(weight: torch.Tensor, bias: torch.Tensor, inputs: torch.Tensor) -> None:
    """A forward and backward of a few layers on one sample of four features: ops that do next to nothing."""
    hidden = inputs
    for _ in range(4):
        hidden = torch.relu(torch.nn.functional.linear(hidden, weight, bias))
    hidden.sum().backward()  # type: ignore[no-untyped-call]


def _op_overhead() -> float:
    """Seconds one op of a training step adds beyond its arithmetic and memory traffic (its dispatch)."""
    weight = torch.ones(4, 4, requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    inputs = torch.ones(1, 4)
    counter = _OpCount()
    with counter:
        _tiny_step(weight, bias, inputs)

    def steps() -> None:
        for _ in range(TINY_STEPS):
            _tiny_step(weight, bias, inputs)

    return _median_seconds(steps, repeats=3) / (TINY_STEPS * counter.ops)


@functools.cache
def measure_host_peaks() -> DevicePeaks:
    """The CPU of the machine as torch runs on it now, measured once per process (about a second).

    The figures are what torch's own kernels reached with its current thread count: they are achieved rates, so
    ``achieved`` is 1.0. TF32 does not exist on a CPU (its figure is fp32's).
    """
    fp32 = _matmul_flops(torch.float32)
    bf16 = _matmul_flops(torch.bfloat16)
    fp16 = _matmul_flops(torch.float16, HALF_SIZE)
    bandwidth = _copy_bandwidth()
    overhead = _op_overhead()
    threads = torch.get_num_threads()
    return DevicePeaks(
        name=f"this CPU ({threads} threads)",
        fp32_flops=fp32,
        tf32_flops=fp32,
        bf16_flops=bf16,
        fp16_flops=fp16,
        bandwidth=bandwidth,
        op_overhead_seconds=overhead,
        source=(
            f"measured in this process: a {MATMUL_SIZE}x{MATMUL_SIZE} matrix product, a {COPY_BYTES // 2**20} MiB"
            f" copy, a tiny forward and backward; median of {REPEATS} repeats, {threads} threads"
        ),
        achieved=1.0,
    )
