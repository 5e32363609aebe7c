"""The monitor's settings, checked when the callback is built, and the arguments of a run, checked when it starts."""

from __future__ import annotations

import difflib
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch
from torch import nn

from lightning_vram.measure.probes import Probe
from lightning_vram.measure.timing import Clock
from lightning_vram.render.publishing import Publisher
from lightning_vram.units import parse_size

MAX_STEPS = 10**12
"""Upper bound of every option counted in training steps (a trillion steps: far beyond any run)."""
MAX_RECENT_STEPS = 10**6
"""Upper bound of ``recent_steps``: the recent step peaks kept in memory for charts."""
MAX_TOP_MODULES = 10**4
"""Upper bound of ``top_modules``: rows of the module table in the report."""
MAX_HISTORY_ENTRIES = 10**7
"""Upper bound of ``history_max_entries``: allocation events (each with its Python stack) kept in memory."""
MIN_INTERVAL_SECONDS = 0.01
"""Lower bound of ``utilization_interval_seconds``: NVML's own sample window is 1/6 s to 1 s."""
MAX_INTERVAL_SECONDS = 60.0
"""Upper bound of ``utilization_interval_seconds``: a longer wait leaves most log intervals without a sample."""
MAX_WORLD_SIZE = 10**7
"""Upper bound of ``world_size`` (and of a rank): processes training together, far beyond any cluster."""
MAX_REPLAY_BUDGET_SECONDS = 3600.0
"""Upper bound of ``replay_budget_seconds``: an hour of host time, far above what a replay of a large model takes."""
MAX_LENGTH = 10**9
"""Upper bound of ``max_length`` and of each size of ``max_shape`` (elements along a batch dimension)."""
MAX_SHAPE_DIMS = 64
"""Upper bound of the dimensions of ``max_shape`` (torch's own limit on a tensor's dimensions)."""


def require_int(name: str, value: object, minimum: int, maximum: int, allow_none: bool = False) -> None:
    """Check that ``value`` is an int from ``minimum`` to ``maximum`` (or ``None`` where allowed), naming ``name``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


MAX_MEMORY_BUDGET = 2**50
"""Upper bound of ``memory_budget``: a pebibyte, far beyond any device."""


def memory_budget_bytes(name: str, value: object) -> int | None:
    """``value`` (bytes, or a string such as ``"20GiB"`` or ``"512 MB"``) as bytes; ``None`` stays ``None``.

    Raises a ValueError naming ``name`` for anything else, or a budget of 0 bytes or above :data:`MAX_MEMORY_BUDGET`.

    >>> memory_budget_bytes("memory_budget", "1.5 GiB"), memory_budget_bytes("memory_budget", 4096)
    (1610612736, 4096)
    """
    what = 'a number of bytes (an int > 0) or a string such as "20GiB" or "512MB"'
    if value is None:
        return None
    if isinstance(value, str):
        parsed = parse_size(value)
        if parsed is None:
            raise ValueError(f"{name} must be {what}, got {value!r}")
        value = parsed
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    if not 0 < value <= MAX_MEMORY_BUDGET:
        raise ValueError(f"{name} must be {what}, at most {MAX_MEMORY_BUDGET} bytes, got {value!r}")
    return value


def require_shape(name: str, value: object) -> None:
    """Check that ``value`` is ``None`` or a non-empty tuple of ints from 1 to :data:`MAX_LENGTH`, naming ``name``.

    Whether it has as many sizes as the batch has dimensions past its batch dimension is checked when the batch is
    seen.

    >>> require_shape("max_shape", (3, 0))
    Traceback (most recent call last):
    ...
    ValueError: max_shape must be a tuple of ints >= 1 (a size per dimension past the batch's), got (3, 0)
    """
    if value is None:
        return
    what = "a tuple of ints >= 1 (a size per dimension past the batch's)"
    if not isinstance(value, tuple) or not all(type(size) is int for size in value):
        raise TypeError(f"{name} must be {what} or None, got {value!r} ({type(value).__name__})")
    if not value or len(value) > MAX_SHAPE_DIMS or not all(size >= 1 for size in value):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if max(value) > MAX_LENGTH:
        raise ValueError(f"{name} must have sizes <= {MAX_LENGTH}, got {value!r}")


def require_one_of(first: str, first_value: object, second: str, second_value: object) -> None:
    """Refuse ``first`` and ``second`` given together (both not ``None``): they say the same thing two ways."""
    if first_value is not None and second_value is not None:
        raise ValueError(
            f"{first} and {second} are mutually exclusive: give one, got {first}={first_value!r} and"
            f" {second}={second_value!r}"
        )


def _require_seconds(name: str, value: object, minimum: float, maximum: float) -> None:
    what = f"{name} must be a positive number of seconds from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= maximum:  # also infinity and NaN
        raise ValueError(f"{what}, got {value!r}")


def _require_budget(name: str, value: object, maximum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds from 0 to {maximum}, got {value!r} ({type(value).__name__})"
        )
    if not 0 <= value <= maximum:  # NaN fails too
        raise ValueError(f"{name} must be a number of seconds from 0 (off) to {maximum}, got {value!r}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


class MonitorOptions(TypedDict, total=False):
    """The monitor's options, documented here once.

    Keywords of :class:`~lightning_vram.VramMonitor`, :class:`~lightning_vram.VramSession` and
    :class:`MonitorConfig` (which holds their defaults and checks them).

    Attributes:
        log_every_n_steps: training batches between logged scalars; ``None`` uses the Trainer's setting (50 outside
            a Trainer).
        attribution_start_step: the first training batch (0-based, over the whole run) counted tensor by
            tensor. The default, 2, skips the first step, where optimizer state is still being created.
        attribution_every_n_steps: batches between counted steps after the first; ``None`` counts one step.
            A counted step costs extra Python time per saved tensor.
        reset_peak_stats: reset the CUDA allocator's peak at each phase boundary to measure exact phase
            peaks. This is process-wide: code of yours that reads ``torch.cuda.max_memory_allocated()``
            sees the peak since the last boundary. ``False`` leaves it untouched; phase peaks are then
            exact when they set a new process peak and a lower bound otherwise.
        utilization_interval_seconds: seconds between NVML utilization samples (background thread).
        top_modules: how many modules the report lists by saved activation bytes.
        recent_steps: how many recent step peaks are kept for charts (memory stays bounded).
        console_summary: print a short summary at the end of training (global rank zero).
        record_history: record the CUDA allocator's history (every allocation and free with its Python stack)
            so that an out-of-memory error also leaves a snapshot for PyTorch's memory visualizer. Off by
            default: recording costs host time on every allocation and holds up to ``history_max_entries``
            events in memory.
        history_max_entries: allocation events the history keeps (the oldest are dropped).
        replay_budget_seconds: host seconds the monitor may spend, once per run, replaying the first sampled step
            under fake tensors (no device memory) to try each change it could advise; advice whose change was
            replayed says "simulated". 0 turns replays off (advice is then modelled).
        preflight: on a CUDA device, replay the first step before it runs and warn when it is predicted not to fit
            the free memory, with the replayed changes that would make it fit. On by default: it costs one replay
            of host time, once, and can save a run from dying at its first step.
        max_length: the longest sequence the run is expected to see, along the batch's length dimension (dimension
            1 of its first tensor with two or more: a language model's tokens). Preflight replays the first batch
            resized to it before step 0 (on CUDA it warns when that step would not fit) and the report lists its
            predicted peak beside the lengths replayed. ``None``: the DataLoader's own longest length where it tells
            one (a sampler that lists every sample's length, a transformers collator padding to its ``max_length``),
            else only the lengths that arrive are replayed (the largest when it first arrives).
        max_shape: the largest size of each dimension past the batch's the run is expected to see, for the batch's
            first tensor with two or more dimensions: ``(3, 512, 512)`` for images batched as ``(B, 3, H, W)``,
            ``(2048,)`` for tokens. Preflight replays the first batch resized to it, as for ``max_length``: in every
            batch tensor, each dimension whose size is one of that first tensor's takes its new size (matched from
            the last dimension where two of its sizes are equal: an image and its mask); the report lists the peak
            under the size along the first dimension that changed. A batch with another number of dimensions warns
            once and is checked as it is. Mutually exclusive with ``max_length``.
        probe: read the device through this probe instead of the one that fits the device; for tests,
            see :class:`lightning_vram.testing.ScriptedProbe`.
        clock: the host clock step times and data wait are read from, in seconds; for tests, which script it
            (the default is ``time.perf_counter``). Checked to be callable at construction but not called then (a
            scripted clock, such as an iterator's ``__next__``, would lose a reading): one that returns no number
            turns step timing off at the first step, with a warning that says so.
    """

    log_every_n_steps: int | None
    attribution_start_step: int
    attribution_every_n_steps: int | None
    reset_peak_stats: bool
    utilization_interval_seconds: float
    top_modules: int
    recent_steps: int
    console_summary: bool
    record_history: bool
    history_max_entries: int
    replay_budget_seconds: float
    preflight: bool
    max_length: int | None
    max_shape: tuple[int, ...] | None
    probe: Probe | None
    clock: Clock


def check_option_names(owner: str, given: Collection[str], own: Collection[str] = ()) -> None:
    """Refuse a keyword of ``owner`` that is not an option (nor one of ``own``), naming the closest one.

    >>> check_option_names("VramMonitor", ["log_every_n_step"])
    Traceback (most recent call last):
    ...
    TypeError: VramMonitor got an unexpected keyword argument 'log_every_n_step'; did you mean 'log_every_n_steps'?
    """
    names = sorted({*MonitorOptions.__annotations__, *own})
    for name in given:
        if name not in names:
            closest = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {closest[0]!r}?" if closest else f"its options are {', '.join(names)}"
            raise TypeError(f"{owner} got an unexpected keyword argument {name!r}; {hint}")


@dataclass(frozen=True)
class MonitorConfig:
    """The options of :class:`MonitorOptions` with their defaults, checked when built.

    Raises:
        TypeError, ValueError: an option is not what it must be (the message names it, what it must be and what
            it got), or is not an option.
    """

    log_every_n_steps: int | None = None
    attribution_start_step: int = 2
    attribution_every_n_steps: int | None = 100
    reset_peak_stats: bool = True
    utilization_interval_seconds: float = 0.5
    top_modules: int = 10
    recent_steps: int = 512
    console_summary: bool = True
    record_history: bool = False
    history_max_entries: int = 100_000
    replay_budget_seconds: float = 30.0
    preflight: bool = True
    max_length: int | None = None
    max_shape: tuple[int, ...] | None = None
    probe: Probe | None = field(default=None, compare=False)
    clock: Clock = field(default=time.perf_counter, compare=False)

    def __post_init__(self) -> None:
        require_int("log_every_n_steps", self.log_every_n_steps, 1, MAX_STEPS, allow_none=True)
        require_int("attribution_start_step", self.attribution_start_step, 0, MAX_STEPS)
        require_int("attribution_every_n_steps", self.attribution_every_n_steps, 1, MAX_STEPS, allow_none=True)
        _require_bool("reset_peak_stats", self.reset_peak_stats)
        interval = self.utilization_interval_seconds
        _require_seconds("utilization_interval_seconds", interval, MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS)
        require_int("top_modules", self.top_modules, 1, MAX_TOP_MODULES)
        require_int("recent_steps", self.recent_steps, 1, MAX_RECENT_STEPS)
        _require_bool("console_summary", self.console_summary)
        _require_bool("record_history", self.record_history)
        require_int("history_max_entries", self.history_max_entries, 1, MAX_HISTORY_ENTRIES)
        _require_budget("replay_budget_seconds", self.replay_budget_seconds, MAX_REPLAY_BUDGET_SECONDS)
        _require_bool("preflight", self.preflight)
        require_int("max_length", self.max_length, 1, MAX_LENGTH, allow_none=True)
        require_shape("max_shape", self.max_shape)
        require_one_of("max_length", self.max_length, "max_shape", self.max_shape)
        probe = self.probe
        if isinstance(probe, type):
            raise TypeError(
                f"probe must be a probe such as ScriptedProbe([...]), got the class {probe.__name__}: create one"
            )
        if probe is not None and not isinstance(probe, Probe):
            raise TypeError(f"probe must implement lightning_vram.measure.probes.Probe, got {type(probe).__name__}")
        if not callable(self.clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(self.clock).__name__}")

    def next_sampled_step(self, step: int) -> int | None:
        """The first training batch from ``step`` on (0-based, over the run) that gets tensor-by-tensor attribution.

        ``None`` when no later batch does.

        >>> MonitorConfig(attribution_start_step=2, attribution_every_n_steps=10).next_sampled_step(13)
        22
        >>> MonitorConfig(attribution_start_step=2, attribution_every_n_steps=None).next_sampled_step(3) is None
        True
        """
        offset = step - self.attribution_start_step
        if offset <= 0:
            return self.attribution_start_step
        every = self.attribution_every_n_steps
        return None if every is None else step + -offset % every


WRITER_METHODS = ("add_text", "add_custom_scalars", "add_image", "get_logdir", "flush", "close")
"""What the monitor calls on a TensorBoard writer (``torch.utils.tensorboard``'s and ``tensorboardX``'s have them)."""


def _shown(value: object) -> str:
    return "None" if value is None else f"{value!r} ({type(value).__name__})"


def _require_callable(name: str, value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, got {_shown(value)}")


def _require_list(name: str, value: object, what: str) -> Sequence[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        shown = repr(value) if isinstance(value, (str, bytes)) else type(value).__name__
        raise TypeError(f"{name} must be a list of {what}, got {shown}")
    return value


def _require_optimizers(optimizers: object) -> None:
    if callable(optimizers):
        return  # read on each sampled step
    items = _require_list("optimizers", optimizers, "optimizers or a callable returning them")
    for index, optimizer in enumerate(items):
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizers[{index}] must be an optimizer (with param_groups), got {_shown(optimizer)}")


def _require_publishers(publishers: object) -> None:
    for index, publisher in enumerate(_require_list("publishers", publishers, "Publishers")):
        if not isinstance(publisher, Publisher):
            raise TypeError(
                f"publishers[{index}] must be a lightning_vram.Publisher (lightning_vram.publisher_for(logger) makes"
                f" one of a Lightning logger), got {_shown(publisher)}"
            )


def _require_writers(writers: object) -> None:
    for index, writer in enumerate(_require_list("tensorboard", writers, "SummaryWriters")):
        if not all(callable(getattr(writer, method, None)) for method in WRITER_METHODS):
            raise TypeError(
                f"tensorboard[{index}] must be a SummaryWriter (with {', '.join(WRITER_METHODS)}),"
                f" got {type(writer).__name__}"
            )


def start_device(device: object) -> torch.device | None:
    """``VramSession.start``'s ``device``: a ``torch.device``, a device string (``"cuda:1"``) made one, or ``None``.

    >>> start_device("cuda:1")
    device(type='cuda', index=1)
    """
    if device is None or isinstance(device, torch.device):
        return device
    message = f"device must be a torch.device or a device string such as 'cuda:1', got {_shown(device)}"
    if not isinstance(device, str):
        raise TypeError(message)
    try:
        return torch.device(device)
    except RuntimeError:  # torch's "Invalid device string"
        raise ValueError(message.removesuffix(" (str)")) from None


PRECISIONS = (
    "32-true",
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
)
"""The precisions Lightning 2 names (``Trainer(precision=...)``, ``Fabric(precision=...)``)."""

PRECISION_ALIASES: dict[str | int, str] = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
"""Lightning's older names and what it takes each for (``"bf16"`` is ``"bf16-mixed"``), and the same as ints."""
PRECISION_ALIASES.update({int(name): full for name, full in PRECISION_ALIASES.items() if name != "bf16"})


def precision_name(precision: object) -> str:
    """``precision`` as Lightning names it, its older names (``"bf16"``, ``16``) taken as Lightning takes them.

    >>> precision_name("bf16-mixed"), precision_name("bf16"), precision_name(32)
    ('bf16-mixed', 'bf16-mixed', '32-true')

    Raises:
        TypeError, ValueError: not one of Lightning's precisions (the message names the argument and lists them).
    """
    if isinstance(precision, (str, int)) and not isinstance(precision, bool):
        if precision in PRECISIONS:
            return str(precision)
        if precision in PRECISION_ALIASES:
            return PRECISION_ALIASES[precision]
    error = ValueError if isinstance(precision, (str, int)) and not isinstance(precision, bool) else TypeError
    names = ", ".join(repr(name) for name in (*PRECISIONS, *PRECISION_ALIASES))
    raise error(f"precision must be one of Lightning's precisions ({names}), got {_shown(precision)}")


def check_start(
    model: object,
    optimizers: object,
    *,
    precision: object,
    setup: object,
    rank: object,
    world_size: object,
    gather: object,
    barrier: object,
    tensorboard: object,
    publishers: object,
    default_log_every_n_steps: object,
    step_function: object,
    wrapper: object = None,
    accumulate_grad_batches: object = None,
) -> None:
    """Check ``VramSession.start``'s arguments; the first bad one raises a TypeError or ValueError naming it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_shown(model)}")
    _require_optimizers(optimizers)
    precision_name(precision)
    require_int("rank", rank, 0, MAX_WORLD_SIZE)
    require_int("world_size", world_size, 1, MAX_WORLD_SIZE)
    if isinstance(rank, int) and isinstance(world_size, int) and rank >= world_size:  # ints: checked above
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    for name, function in (
        ("setup", setup),
        ("gather", gather),
        ("barrier", barrier),
        ("step_function", step_function),
        ("wrapper", wrapper),
    ):
        _require_callable(name, function)
    _require_writers(tensorboard)
    _require_publishers(publishers)
    require_int("default_log_every_n_steps", default_log_every_n_steps, 1, MAX_STEPS, allow_none=True)
    require_int("accumulate_grad_batches", accumulate_grad_batches, 1, MAX_STEPS, allow_none=True)
