"""The CPU of the machine, measured: matrix-product FLOP/s, copy bandwidth and the seconds each op of a step adds.

A CPU has no datasheet figure a step could be predicted from (its clocks, cores, vector units and the threads torch
uses all vary), so its :class:`~lightning_vram.prediction.timing.peaks.DevicePeaks` are measured, once per process
(about a second), with torch's own kernels and thread count: a matrix product in fp32, bf16 and fp16, a large
copy, and a tiny training step whose ops do next to nothing (its time over its op count is the cost of an op in a
training step: dispatch, autograd's bookkeeping, the Python around each op, the allocator). A CPU's
kernels reach their roofline unevenly (a convolution less than a matrix product, a max-pool or a batch norm a
fraction of the copy's bandwidth, a tanh or a random mask bound by arithmetic that torch's FLOP formulas do not
count): each such kind of op is run on a small model's tensor sizes, its outputs kept as a step keeps its
activations, and its measured share of its roofline kept (``DevicePeaks.op_achieved``). Each figure is the median
of a few repeats.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from lightning_vram.measure.live import outside_dispatch_modes, outside_function_modes
from lightning_vram.measure.saved_hooks import saved_tensor_hooks_active
from lightning_vram.prediction.containment.installed import installed_user_code
from lightning_vram.prediction.replay._fake import TorchDispatchMode
from lightning_vram.prediction.replay.flops import StepFlops
from lightning_vram.prediction.timing.peaks import OP_FAMILIES, DevicePeaks

MATMUL_SIZE = 512
"""Rows (and columns) of the square matrices multiplied to measure FLOP/s."""
HALF_SIZE = 128
"""Rows of the fp16 product: a CPU without fp16 arithmetic runs it far slower, and its rate is flat in size."""
COPY_BYTES = 32 * 1024 * 1024
"""Bytes of the tensor copied to measure bandwidth (larger than a CPU's caches)."""
REPEATS = 3
"""Timed repeats of each measurement, after one untimed warm-up; the median is kept."""
TINY_STEPS = 20
"""Tiny training steps timed together, for the cost of one op."""
PROBED_KINDS = (
    "convolution",
    "convolution_backward",
    "native_batch_norm",
    "native_batch_norm_backward",
    "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward",
    "relu",
    "threshold_backward",
    "tanh",
    "_softmax",
    "bmm",
    "native_layer_norm",
    "bernoulli_",
)
"""The kinds of op whose measured share of the roofline a CPU's prediction uses (:func:`_probes` runs each)."""


Clock = Callable[[], float]
"""A clock in seconds: ``time.perf_counter`` (wall time) or ``time.process_time`` (this process's CPU time)."""


def _median_seconds(work: Callable[[], object], repeats: int, clock: Clock) -> float:
    """The median seconds of ``work`` by ``clock`` over ``repeats`` runs, after one run not timed."""
    work()
    times = []
    for _ in range(repeats):
        started = clock()
        work()
        times.append(clock() - started)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, size: int, repeats: int, clock: Clock) -> float:
    """FLOP/s of a square matrix product of ``size`` rows in ``dtype`` (the median of ``repeats``)."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(dtype)
    right = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(left, right, out=out), repeats, clock)
    return 2 * size**3 / seconds


def _probes() -> dict[str, Callable[[], object]]:
    """One call of each kind of op whose share of the roofline is measured, on tensors of a small model's sizes.

    Forward ops and their backward, each called directly (``torch.ops.aten``) with what its forward gave.
    """
    aten = torch.ops.aten
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(32, 32, 32, 32, generator=generator)  # 4 MiB: a small CNN's activation
    few = torch.randn(8, 32, 32, 32, generator=generator)
    weight = torch.randn(32, 32, 3, 3, generator=generator)
    gradient = torch.randn(32, 32, 32, 32, generator=generator)
    rows = torch.randn(4096, 256, generator=generator)  # 4 MiB: a small transformer's hidden states
    mask = torch.empty_like(rows)
    queries = torch.randn(16, 128, 32, generator=generator)  # a small transformer's attention, heads batched
    keys = torch.randn(16, 32, 128, generator=generator)
    scores = torch.randn(16, 128, 128, generator=generator)
    scale, shift, mean, variance = torch.ones(32), torch.zeros(32), torch.zeros(32), torch.ones(32)
    _, saved_mean, saved_invstd = aten.native_batch_norm(images, scale, shift, mean, variance, True, 0.1, 1e-5)
    pooled, indices = aten.max_pool2d_with_indices(images, [2, 2], [2, 2])
    both = [True, True, False]
    return {
        "convolution": lambda: aten.convolution(few, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        "convolution_backward": lambda: aten.convolution_backward(
            few, few, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, both
        ),
        "native_batch_norm": lambda: aten.native_batch_norm(images, scale, shift, mean, variance, True, 0.1, 1e-5),
        "native_batch_norm_backward": lambda: aten.native_batch_norm_backward(
            images, images, scale, mean, variance, saved_mean, saved_invstd, True, 1e-5, [True, True, True]
        ),
        "max_pool2d_with_indices": lambda: aten.max_pool2d_with_indices(images, [2, 2], [2, 2]),
        "max_pool2d_with_indices_backward": lambda: aten.max_pool2d_with_indices_backward(
            pooled, images, [2, 2], [2, 2], [0, 0], [1, 1], False, indices
        ),
        "relu": lambda: aten.relu(images),
        "threshold_backward": lambda: aten.threshold_backward(gradient, images, 0),
        "tanh": lambda: aten.tanh(rows),
        "_softmax": lambda: aten._softmax(scores, -1, False),
        "bmm": lambda: aten.bmm(queries, keys),
        "native_layer_norm": lambda: aten.native_layer_norm(rows, [256], None, None, 1e-5),
        "bernoulli_": lambda: aten.bernoulli_(mask, 0.9, generator=generator),
    }


class _Roofline(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch ships it without annotations
    """The FLOPs and bytes of the one op run inside it, as the replay counts them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counted = StepFlops()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        self.counted.count(func, args, kwargs, output)
        return output


def _keeping(probe: Callable[[], object]) -> Callable[[], None]:
    """``probe``, its outputs kept: as a step keeps its activations, each output takes memory not used before."""
    kept: list[object] = []
    return lambda: kept.append(probe())


def _op_achieved(
    fp32: float, bandwidth: float, repeats: int, clock: Clock, kinds: Iterable[str] | None = None
) -> dict[str, float]:
    """Each probed kind of op's share of its roofline time (FLOPs at ``fp32`` FLOP/s, bytes at ``bandwidth``).

    ``kinds``: only these of the probed kinds (``None``: every one).
    """
    shares = {}
    wanted = None if kinds is None else set(kinds)
    for name, probe in _probes().items():
        if wanted is not None and name not in wanted:
            continue
        roofline = _Roofline()
        with roofline:
            probe()
        work = roofline.counted.work()
        ideal = sum(max(group.flops / fp32, group.bytes_moved / bandwidth) * group.count for group in work.groups)
        shares[name] = ideal / _median_seconds(_keeping(probe), repeats, clock)
    return shares


def _copy_bandwidth(repeats: int, clock: Clock) -> float:
    """Bytes a second read and written by a copy of :data:`COPY_BYTES` (each byte counted read and written)."""
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    seconds = _median_seconds(lambda: target.copy_(source), repeats, clock)
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


def _tiny_step(parameters: list[torch.Tensor], moments: list[torch.Tensor], inputs: torch.Tensor) -> None:
    """A training step of four tiny linear layers with ReLU and an Adam-like update: ops that do next to nothing.

    Functional, with no module or optimizer: their calls would run the process's global module and optimizer
    hooks, which belong to the user.
    """
    hidden = inputs
    for index in range(0, len(parameters), 2):
        hidden = torch.relu(torch.nn.functional.linear(hidden, parameters[index], parameters[index + 1]))
    hidden.sum().backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for parameter, first, second in zip(parameters, moments[::2], moments[1::2], strict=True):
            gradient = parameter.grad
            assert gradient is not None  # every parameter is used
            first.lerp_(gradient, 0.1)
            second.mul_(0.999).addcmul_(gradient, gradient, value=0.001)
            parameter.addcdiv_(first, second.sqrt().add_(1e-8), value=-1e-3)
            parameter.grad = None


def _op_overhead(repeats: int, clock: Clock) -> float:
    """Seconds one op of a training step adds beyond its arithmetic and memory traffic.

    Its dispatch, autograd's bookkeeping, the Python around each op: a tiny training step timed, over the ops it
    dispatches.
    """
    parameters = [torch.full(shape, 0.1, requires_grad=True) for _ in range(4) for shape in ((4, 4), (4,))]
    moments = [torch.zeros_like(parameter) for parameter in parameters for _ in range(2)]
    inputs = torch.ones(1, 4)
    counter = _OpCount()
    with counter:
        _tiny_step(parameters, moments, inputs)

    def steps() -> None:
        for _ in range(TINY_STEPS):
            _tiny_step(parameters, moments, inputs)

    return _median_seconds(steps, max(1, repeats // 2), clock) / (TINY_STEPS * counter.ops)


def _passed_through(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor, kept as it is (the pair of hooks that stands in front of the caller's)."""
    return tensor


@contextlib.contextmanager
def _apart_from_the_caller() -> Iterator[None]:
    """The caller's dispatch modes and torch-function modes off the stack, its saved-tensor hooks out of reach.

    The measurement runs in the user's process, at the end of a run or inside ``predict()``: an op counter, a
    ``FlopCounterMode`` or a torch-function mode around ``fit``, or a pair of saved-tensor hooks, must not see its
    ops. torch runs only the top pair of saved-tensor hooks: where the caller has one, a pair that keeps each tensor
    as it is stands in front of it (none otherwise: the tiny step saves as a training step does).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(outside_function_modes())
        stack.enter_context(outside_dispatch_modes())
        if saved_tensor_hooks_active():
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_passed_through, _passed_through))
        yield


_MEASURED: list[DevicePeaks] = []
"""This process's measurement (:func:`measure_host_peaks`), its kinds of op as far as a call asked for them."""


def measure_host_peaks(kinds: Iterable[str] | None = None) -> DevicePeaks | None:
    """The CPU of the machine as torch runs on it, measured once per process; later calls reuse it.

    ``kinds``: the kinds of op whose share of the roofline a step needs (op names, as
    :data:`~lightning_vram.prediction.timing.peaks.OP_FAMILIES` groups them; ``None``: every kind probed). The first
    call measures the matrix products, the copy and the cost of an op (about a second), and each kind is measured
    the first time a call names it (0.1 to 0.5 s each), so a run prices its step without measuring kinds it does not
    run. See :func:`measure_host`.

    ``None``, nothing measured, while a function of the user's is installed in torch's or Python's namespaces
    (``F.linear = counting_linear``: :mod:`~lightning_vram.prediction.containment.installed`): the measurement calls
    torch's functions and tensor methods by name, and would call the user's. Its callers price replayed steps, which
    the same finding refuses, so it is skipped only where a function was installed after a round's replays ran; a
    step is then not priced on the CPU.
    """
    names = set(PROBED_KINDS) if kinds is None else {OP_FAMILIES.get(kind, kind) for kind in kinds}
    wanted = names & set(PROBED_KINDS)
    if _MEASURED and wanted <= set(_MEASURED[0].op_achieved):
        return _MEASURED[0]
    if installed_user_code():
        return None
    if not _MEASURED:
        _MEASURED.append(measure_host(kinds=names))
    peaks = _MEASURED[0]
    missing = wanted - set(peaks.op_achieved)
    if missing:
        with isolated_measurement():
            shares = _op_achieved(peaks.fp32_flops, peaks.bandwidth, REPEATS, time.perf_counter, missing)
        peaks = replace(peaks, op_achieved={**peaks.op_achieved, **shares})
        _MEASURED[0] = peaks
    return peaks


def isolated_measurement() -> contextlib.AbstractContextManager[object]:
    """Around a measurement: the caller's modes and hooks out of reach, its RNG kept, backward whatever the grad mode.

    See :func:`_apart_from_the_caller`.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(_apart_from_the_caller())
    stack.enter_context(torch.random.fork_rng(devices=[]))
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.enable_grad())
    return stack


def measure_host(
    repeats: int = REPEATS, clock: Clock = time.perf_counter, kinds: Iterable[str] | None = None
) -> DevicePeaks:
    """The CPU of the machine as torch runs on it now, each figure the median of ``repeats`` runs timed by ``clock``.

    ``kinds``: the kinds of op whose share of the roofline is measured (``None``: every kind probed).

    The figures are what torch's own kernels reached with its current thread count: they are achieved rates, so
    ``achieved`` is 1.0. TF32 does not exist on a CPU (its figure is fp32's). Measured again at each call: a
    comparison with a measured step on a busy machine measures both at the same time, in turns. With
    ``clock=time.process_time`` and one torch thread, the figures are per second of CPU time, which other
    processes on the machine change far less than wall time (what it waits for the CPU is left out).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    # The probes draw random numbers (the caller's RNG stays) and the tiny step runs backward, whatever the caller's
    # grad mode; none of the caller's modes or hooks sees an op of it.
    with isolated_measurement():
        fp32 = _matmul_flops(torch.float32, MATMUL_SIZE, repeats, clock)
        bf16 = _matmul_flops(torch.bfloat16, MATMUL_SIZE, repeats, clock)
        fp16 = _matmul_flops(torch.float16, HALF_SIZE, repeats, clock)
        bandwidth = _copy_bandwidth(repeats, clock)
        overhead = _op_overhead(repeats, clock)
        op_achieved = _op_achieved(fp32, bandwidth, repeats, clock, kinds)
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
            f" copy, a tiny training step; median of {repeats} repeats, {threads} threads,"
            f" {'CPU time' if clock is time.process_time else 'wall time'}"
        ),
        achieved=1.0,
        op_achieved=op_achieved,
    )
