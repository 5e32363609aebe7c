"""The caching allocator's settings, read from its configuration string as torch reads it.

torch (``c10/core/AllocatorConfig.cpp`` from 2.9 on, ``c10/cuda/CUDAAllocatorConfig.cpp`` before) splits the string
into tokens at ``,``, ``:``, ``[`` and ``]`` (spaces dropped) and reads ``key:value`` pairs. ``PYTORCH_ALLOC_CONF``,
when set, is the only one read (torch 2.9 and later); otherwise ``PYTORCH_CUDA_ALLOC_CONF`` (the only name before 2.9).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

MIB = 1024 * 1024
LARGE_BUFFER_BYTES = 20 * MIB
"""``kLargeBuffer``: the segment of a large request under 10 MiB, and the default rounding of an oversize block."""
ROUNDUP_INTERVALS = 16
"""``kRoundUpPowerOfTwoIntervals``: one division count per power-of-two interval, from below 2 MiB up to 32 GiB."""
ENVIRONMENT_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The variables torch reads, the first one set winning (torch 2.9 and later; earlier ones read only the second)."""
BACKENDS = ("native", "cudaMallocAsync", "async")
IGNORED_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_device_malloc",
        "pinned_use_cuda_host_register",
        "pinned_use_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
    }
)
"""Keys torch accepts that change nothing about what device memory the caching allocator holds (pinned host memory,
locking, CUDA graphs): read and dropped."""
DEFAULT_DIVISIONS: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
_INTEGER = re.compile(r"[+-]?[0-9]+")
"""What ``std::stoi`` reads: the digits a value starts with (the rest is ignored, as torch ignores it)."""
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
"""What ``std::stod`` reads of a decimal number."""


def _tokens(text: str) -> list[str]:
    """The configuration split as torch's ``lexArgs`` splits it.

    >>> _tokens("expandable_segments:True, max_split_size_mb:128")
    ['expandable_segments', ':', 'True', ',', 'max_split_size_mb', ':', '128']
    """
    tokens: list[str] = []
    word: list[str] = []
    for character in text:
        if character in ",:[]":
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(character)
        elif character != " ":
            word.append(character)
    if word:
        tokens.append("".join(word))
    return tokens


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class AllocatorSettings:
    """What of ``PYTORCH_ALLOC_CONF`` shapes the device memory the caching allocator holds.

    Attributes:
        expandable_segments: one growing segment per stream and pool, mapped in pages (``expandable_segments:True``).
        max_split_size_bytes: blocks of this size or more are never split (``max_split_size_mb``); None: no limit.
        roundup_power2_divisions: per power-of-two interval of request sizes (index 0: below 2 MiB, index i: from
            2**(20+i) bytes, the last one everything from 32 GiB), how many equal steps a request is rounded up to;
            0 or 1: only 512-byte rounding. As torch holds it (``roundup_power2_divisions_``).
        max_non_split_rounding_bytes: an oversize request may take a cached block up to this much larger
            (``max_non_split_rounding_mb``, torch 2.5 and later; 20 MiB before and by default).
        garbage_collection_threshold: the share of the memory fraction above which cached blocks are freed; torch
            acts on it only when a per-process memory fraction is set. None: off.
        backend: ``native`` (the caching allocator) or ``cudaMallocAsync`` (CUDA's own pool, not modelled).
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None
    roundup_power2_divisions: tuple[int, ...] = DEFAULT_DIVISIONS
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    garbage_collection_threshold: float | None = None
    backend: str = "native"

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes <= LARGE_BUFFER_BYTES:
            raise ValueError(
                f"max_split_size_bytes must be above {LARGE_BUFFER_BYTES} or None, got {self.max_split_size_bytes!r}"
            )
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS or any(
            value != 0 and not _is_power_of_two(value) for value in self.roundup_power2_divisions
        ):
            raise ValueError(
                f"roundup_power2_divisions must be {ROUNDUP_INTERVALS} powers of two or 0,"
                f" got {self.roundup_power2_divisions!r}"
            )
        if self.max_non_split_rounding_bytes < LARGE_BUFFER_BYTES:
            raise ValueError(
                f"max_non_split_rounding_bytes must be at least {LARGE_BUFFER_BYTES},"
                f" got {self.max_non_split_rounding_bytes!r}"
            )
        if self.garbage_collection_threshold is not None and not 0.0 < self.garbage_collection_threshold < 1.0:
            raise ValueError(
                f"garbage_collection_threshold must be in (0, 1) or None, got {self.garbage_collection_threshold!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    def divisions(self, size: int) -> int:
        """How many steps torch rounds a request of ``size`` bytes to (its ``roundup_power2_divisions(size)``).

        >>> AllocatorSettings.from_conf("roundup_power2_divisions:[256:1,>:4]").divisions(512 * MIB)
        4
        """
        index = max(size.bit_length() - 1 - 20, 0)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]

    @classmethod
    def from_conf(cls, text: str) -> AllocatorSettings:
        """The settings a configuration string sets, the rest at torch's defaults.

        Raises ValueError naming the key on input torch would refuse (an unknown key, a missing or bad value).

        >>> AllocatorSettings.from_conf("expandable_segments:True,max_split_size_mb:128").max_split_size_bytes
        134217728
        """
        tokens = _tokens(text)
        values: dict[str, object] = {}
        index = 0
        while index < len(tokens):
            key = tokens[index]
            if index + 1 >= len(tokens) or tokens[index + 1] != ":" or index + 2 >= len(tokens):
                raise ValueError(f"PYTORCH_ALLOC_CONF: {key!r} needs a value ('{key}:VALUE'), got {text!r}")
            index += 2
            if key == "roundup_power2_divisions":
                values[key], index = _divisions(tokens, index)
            else:
                values[key] = _value(key, tokens[index])
                index += 1
            if index < len(tokens):
                if tokens[index] != ",":
                    raise ValueError(f"PYTORCH_ALLOC_CONF: expected ',' after {key!r}, got {tokens[index]!r}")
                index += 1
        return cls(
            expandable_segments=bool(values.get("expandable_segments", False)),
            max_split_size_bytes=_optional_int(values.get("max_split_size_mb")),
            roundup_power2_divisions=values.get("roundup_power2_divisions", DEFAULT_DIVISIONS),  # type: ignore[arg-type]
            max_non_split_rounding_bytes=_optional_int(values.get("max_non_split_rounding_mb")) or LARGE_BUFFER_BYTES,
            garbage_collection_threshold=values.get("garbage_collection_threshold"),  # type: ignore[arg-type]
            backend=str(values.get("backend", "native")),
        )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> AllocatorSettings:
        """The settings a run has: ``PYTORCH_ALLOC_CONF`` when set (even empty), else ``PYTORCH_CUDA_ALLOC_CONF``.

        >>> AllocatorSettings.from_environment({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).conf()
        'expandable_segments:True'
        """
        environment = os.environ if environ is None else environ
        for name in ENVIRONMENT_NAMES:
            text = environment.get(name)
            if text is not None:
                return cls.from_conf(text)
        return cls()

    def conf(self) -> str:
        """The configuration string that sets these settings; ``""`` for the defaults.

        >>> AllocatorSettings.from_conf("max_split_size_mb:256, expandable_segments:True").conf()
        'expandable_segments:True,max_split_size_mb:256'
        """
        parts: list[str] = []
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MIB}")
        if self.max_non_split_rounding_bytes != LARGE_BUFFER_BYTES:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // MIB}")
        if self.roundup_power2_divisions != DEFAULT_DIVISIONS:
            divisions = self.roundup_power2_divisions
            if len(set(divisions)) == 1:
                parts.append(f"roundup_power2_divisions:{divisions[0]}")
            else:
                listed = ",".join(f"{1 << index}:{value}" for index, value in enumerate(divisions))
                parts.append(f"roundup_power2_divisions:[{listed}]")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        return ",".join(parts)


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value) * MIB  # type: ignore[call-overload]


def _integer(key: str, text: str) -> int:
    """The integer ``text`` starts with, as C++'s ``std::stoi`` reads it (``128MB`` is 128); ValueError without one.

    >>> _integer("max_split_size_mb", "128MB")
    128
    """
    match = _INTEGER.match(text)
    if match is None:
        raise ValueError(f"PYTORCH_ALLOC_CONF: {key} must be an integer, got {text!r}")
    return int(match.group())


def _boolean(key: str, text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"PYTORCH_ALLOC_CONF: {key} must be True or False, got {text!r}")
    return text == "True"


def _value(key: str, text: str) -> object:
    """One key's value, checked as torch checks it (sizes in MiB are returned in MiB)."""
    if key == "expandable_segments":
        return _boolean(key, text)
    if key == "max_split_size_mb":
        value = _integer(key, text)
        if value <= LARGE_BUFFER_BYTES // MIB:
            raise ValueError(
                f"PYTORCH_ALLOC_CONF: max_split_size_mb must be above {LARGE_BUFFER_BYTES // MIB}, got {value}"
            )
        return value
    if key == "max_non_split_rounding_mb":
        value = _integer(key, text)
        if value < LARGE_BUFFER_BYTES // MIB:
            raise ValueError(
                f"PYTORCH_ALLOC_CONF: max_non_split_rounding_mb must be >= {LARGE_BUFFER_BYTES // MIB}, got {value}"
            )
        return value
    if key == "garbage_collection_threshold":
        match = _NUMBER.match(text)
        if match is None:
            raise ValueError(f"PYTORCH_ALLOC_CONF: garbage_collection_threshold must be a number, got {text!r}")
        threshold = float(match.group())
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"PYTORCH_ALLOC_CONF: garbage_collection_threshold must be in (0, 1), got {text!r}")
        return threshold
    if key == "backend":
        if text not in BACKENDS:
            raise ValueError(f"PYTORCH_ALLOC_CONF: backend must be one of {', '.join(BACKENDS)}, got {text!r}")
        return "native" if text == "native" else "cudaMallocAsync"
    if key in IGNORED_KEYS:
        return text
    raise ValueError(f"PYTORCH_ALLOC_CONF: unrecognized allocator option {key!r}")


def _divisions(tokens: list[str], index: int) -> tuple[tuple[int, ...], int]:
    """``roundup_power2_divisions``: one count for every interval, or ``[MB:count,...,>:count]``; the next index."""
    key = "roundup_power2_divisions"
    if tokens[index] != "[":
        value = _integer(key, tokens[index])
        if not _is_power_of_two(value):
            raise ValueError(f"PYTORCH_ALLOC_CONF: {key} must be a power of two, got {value}")
        return (value,) * ROUNDUP_INTERVALS, index + 1
    divisions = list(DEFAULT_DIVISIONS)
    first = True
    last_index = 0
    index += 1
    while index < len(tokens) and tokens[index] != "]":
        interval = tokens[index]
        if index + 2 >= len(tokens) or tokens[index + 1] != ":":
            raise ValueError(f"PYTORCH_ALLOC_CONF: {key} entries are 'MB:count', got {interval!r}")
        count = _integer(key, tokens[index + 2])
        if count != 0 and not _is_power_of_two(count):
            raise ValueError(f"PYTORCH_ALLOC_CONF: {key} counts must be powers of two or 0, got {count}")
        if interval == ">":
            divisions[last_index:] = [count] * (ROUNDUP_INTERVALS - last_index)
        else:
            megabytes = _integer(key, interval)
            if not _is_power_of_two(megabytes):
                raise ValueError(f"PYTORCH_ALLOC_CONF: {key} intervals must be powers of two, got {megabytes}")
            position = min(megabytes.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                divisions[:position] = [count] * position
                first = False
            divisions[position] = count
            last_index = position
        index += 3
        if index < len(tokens) and tokens[index] == ",":
            index += 1
    if index >= len(tokens):
        raise ValueError(f"PYTORCH_ALLOC_CONF: {key} list has no closing ']'")
    return tuple(divisions), index + 1
