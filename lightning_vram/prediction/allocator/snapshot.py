"""A memory snapshot torch wrote, as the allocations and frees the model replays and the reserved bytes it recorded.

``torch.cuda.memory._dump_snapshot()`` pickles a dict: ``segments`` (the allocator's segments and blocks when it was
taken), ``device_traces`` (per device, the events recorded by ``_record_memory_history``) and, from torch 2.3 on,
``allocator_settings``. Only that file format is read: the unpickler builds plain containers and refuses any other
object, so a file that is not a snapshot cannot run code.

How the events become the model's calls:

- ``alloc`` is a ``malloc`` of the size asked for (the event's ``size``, before rounding) on its stream;
- ``free_completed`` is the ``free``: it is when torch returns the block to its pool (``free_block``). A block used on
  another stream (``record_stream``) is freed by the user at ``free_requested`` but only reusable once its events
  complete, at ``free_completed``. torch lowers ``allocated_bytes`` at ``free_requested``: where the two are apart,
  the model's allocated figure is the block's lifetime to ``free_completed`` (an upper bound);
- ``segment_alloc`` / ``segment_free`` (cudaMalloc / cudaFree) and ``segment_map`` / ``segment_unmap`` (expandable
  segments) are what the allocator did: they are the recorded reserved bytes the model is compared with, never input;
- ``oom``: a request that ran out of memory (its size rounded, and the device's free bytes then). The last is the
  failure the run ended on; torch caught the earlier ones and went on (cuDNN does, trying a convolution algorithm
  whose workspace does not fit and falling back to one needing less): the run survived them and did not need their
  memory, so they are kept as :attr:`SnapshotTrace.survived`, not replayed.

A trace that does not start from an empty device (the history keeps only its last ``max_entries`` events, as the
monitor's ``vram_oom_snapshot.pickle`` does) starts with blocks allocated before its first event: those freed within
the trace (a free with no alloc before it) and those still allocated in ``segments`` that no event touches. The model
starts from them, allocated afresh in address order; what the allocator had cached then is not known, so the
simulated reserved figure is that of a fresh start with the same live blocks. :attr:`SnapshotTrace.from_empty` says
which case a trace is.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_vram.prediction.allocator.model import CachingAllocatorModel, SimulatedOutOfMemory
from lightning_vram.prediction.allocator.settings import (
    DEFAULT_DIVISIONS,
    LARGE_BUFFER_BYTES,
    ROUNDUP_INTERVALS,
    AllocatorSettings,
)

MAX_SNAPSHOT_BYTES = 4 * 1024**3
"""Larger files are not read (a snapshot with a million events and their stacks is a few hundred MiB)."""
MALLOC, FREE, FAILED = 0, 1, 2
"""The kinds of operation in :attr:`SnapshotTrace.operations`: an allocation, a free, the request that ran out of
memory in the recorded run (never served there)."""
SAFE_BUILTINS = frozenset({"set", "frozenset", "complex", "bytearray", "slice", "range"})
"""The only classes a snapshot may name: builtin containers and values (dicts, lists, strings and numbers need none)."""
_SEGMENT_UP = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


class SnapshotError(ValueError):
    """A file that is not a memory snapshot, or one with no trace to replay; the message is one line."""


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds plain containers only: any other global is refused, so unpickling runs no code of the file's choice."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in SAFE_BUILTINS:
            return super().find_class(module, name)
        raise SnapshotError(f"not a memory snapshot (it names {module}.{name})")


def read_snapshot(path: Path) -> dict[str, Any]:
    """The dict a snapshot file holds; :class:`SnapshotError` for a file that is not one (or cannot be read)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(descriptor, "rb") as file:
            status = os.fstat(file.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise SnapshotError(f"{path}: not a regular file")
            if status.st_size > MAX_SNAPSHOT_BYTES:
                raise SnapshotError(f"{path}: {status.st_size} bytes is too large for a memory snapshot")
            data = file.read(MAX_SNAPSHOT_BYTES + 1)
    except FileNotFoundError as error:
        raise SnapshotError(f"{path}: no such file or directory") from error
    except OSError as error:
        raise SnapshotError(f"{path}: {error.strerror or error}") from error
    try:
        loaded = _RestrictedUnpickler(io.BytesIO(data)).load()
    except SnapshotError as error:
        raise SnapshotError(f"{path}: {error}") from error
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as error:
        raise SnapshotError(f"{path}: not a memory snapshot (not a pickle torch wrote: {error})") from error
    except (RecursionError, MemoryError) as error:
        raise SnapshotError(f"{path}: not a memory snapshot (nested too deeply)") from error
    if not isinstance(loaded, dict) or not isinstance(loaded.get("segments"), list):
        raise SnapshotError(f"{path}: not a memory snapshot (no 'segments' list)")
    return loaded


@dataclass(frozen=True)
class FailedRequest:
    """A request that ran out of memory in the recorded run (torch's ``oom`` event), in bytes.

    ``capacity_bytes`` is what the allocator could have held then: what it held plus what the device had free.
    ``event`` is the ``oom`` event's index in the device's trace.
    """

    event: int
    rounded_bytes: int
    device_free_bytes: int
    reserved_bytes: int

    @property
    def capacity_bytes(self) -> int:
        """What the allocator could have held when the request failed: its reserved bytes plus the device's free."""
        return self.reserved_bytes + self.device_free_bytes


@dataclass(frozen=True)
class SnapshotTrace:
    """One device's recorded events as the model's operations, with the reserved bytes torch recorded beside them.

    Attributes:
        operations: ``(kind, block, size, stream)``: :data:`MALLOC` (size as asked for), :data:`FREE` (size 0),
            :data:`FAILED` (the request that ran out of memory, its rounded size; never served in the recorded run).
        device: the device index the trace is of.
        events: how many events the trace holds.
        from_empty: the trace starts from a device with nothing allocated or reserved.
        live_at_start: blocks allocated before the first event, allocated first in :attr:`operations`.
        reserved_at_start_bytes: what the allocator held before the first event (0 from an empty device).
        recorded_reserved_peak_bytes: the largest reserved figure the segment events reach.
        settings: the allocator settings the snapshot says it ran under; None where it does not say (before 2.3).
        failed: the request that ran out of memory and ended the run (the trace's last ``oom`` event), where the
            trace holds one.
        survived: the ``oom`` events before that one, in order: requests torch caught and the run went on from.
        operation_events: the index in the device's trace of the event each operation comes from (-1 for a block
            live at the start).
        released_mid_run: segments freed or unmapped before the trace's last allocation. torch gives a segment back
            only when a cudaMalloc fails (it frees its cache and retries) or on ``torch.cuda.empty_cache()``: a run
            that did so met its device's memory, which a replay with no limit does not (its reserved peak is above).
    """

    operations: tuple[tuple[int, int, int, int], ...]
    device: int
    events: int
    from_empty: bool
    live_at_start: int
    reserved_at_start_bytes: int
    recorded_reserved_peak_bytes: int
    settings: AllocatorSettings | None
    failed: FailedRequest | None
    released_mid_run: int = 0
    survived: tuple[FailedRequest, ...] = ()
    operation_events: tuple[int, ...] = ()


def trace_from_snapshot(snapshot: dict[str, Any], device: int | None = None) -> SnapshotTrace:
    """The trace of ``device`` in a snapshot read by :func:`read_snapshot`; :class:`SnapshotError` where it has none.

    ``device`` None: the first device with a trace (``device_traces[0]`` on one GPU; a process that used only its
    second GPU, as a DDP rank may, records an empty trace for the first).
    """
    traces = snapshot.get("device_traces")
    if device is None and isinstance(traces, list):
        device = next((index for index, events in enumerate(traces) if events), 0)
    device = device or 0
    if not isinstance(traces, list) or len(traces) <= device or not traces[device]:
        raise SnapshotError(
            "no allocation trace in this snapshot (record one with torch.cuda.memory._record_memory_history before"
            " the run)"
        )
    events = traces[device]
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        raise SnapshotError("not a memory snapshot (its device trace is not a list of events)")
    try:
        return _trace(events, snapshot, device)
    except (KeyError, TypeError) as error:
        raise SnapshotError(f"not a memory snapshot (an event or segment lacks {error})") from error


def _trace(events: list[dict[str, Any]], snapshot: dict[str, Any], device: int) -> SnapshotTrace:
    operations: list[tuple[int, int, int, int]] = []
    operation_events: list[int] = []
    live: dict[int, int] = {}
    seeded: list[tuple[int, int, int, int]] = []  # (address, block, size, stream) allocated before the trace
    block = 0
    segment_change = 0
    reserved = 0
    peak = 0
    ooms: list[FailedRequest] = []  # reserved_bytes counted from the trace's start; the start is added below
    last_oom = max((index for index, event in enumerate(events) if event["action"] == "oom"), default=-1)
    touched: set[int] = set()
    released = released_mid_run = 0
    for index, event in enumerate(events):
        action = event["action"]
        if action in ("segment_free", "segment_unmap"):
            released += 1
        if action == "alloc":
            released_mid_run = released
            block += 1
            live[event["addr"]] = block
            touched.add(event["addr"])
            operations.append((MALLOC, block, int(event["size"]), int(event["stream"])))
            operation_events.append(index)
        elif action == "free_completed":
            address = event["addr"]
            freed = live.pop(address, None)
            if freed is None:  # allocated before the trace began
                block += 1
                freed = block
                seeded.append((address, block, int(event["size"]), int(event["stream"])))
            touched.add(address)
            operations.append((FREE, freed, 0, 0))
            operation_events.append(index)
        elif action == "free_requested":
            touched.add(event["addr"])
        elif action in _SEGMENT_UP:
            change = _SEGMENT_UP[action] * int(event["size"])
            segment_change += change
            reserved += change
            peak = max(peak, reserved)
        elif action == "oom":
            # torch names the device's free bytes ``device_free`` (2.11); earlier versions kept them in ``addr``.
            free_bytes = int(event.get("device_free", event.get("addr", 0)))
            ooms.append(FailedRequest(index, int(event["size"]), free_bytes, reserved))
            if index == last_oom:  # the one the run ended on; torch caught the earlier ones and went on
                operations.append((FAILED, block + 1, int(event["size"]), int(event["stream"])))
                operation_events.append(index)
                block += 1
    reserved_at_end = 0
    for segment in snapshot["segments"]:
        if segment.get("device", device) != device:
            continue
        reserved_at_end += int(segment["total_size"])
        address = int(segment["address"])
        for entry in segment["blocks"]:
            if entry.get("state") == "active_allocated" and address not in touched:
                block += 1
                size = int(entry.get("requested_size") or entry["size"])
                seeded.append((address, block, size, int(segment.get("stream", 0))))
            address += int(entry["size"])
    reserved_at_start = reserved_at_end - segment_change
    if reserved_at_start < 0:
        raise SnapshotError("not a memory snapshot (its segments and its trace disagree on what was reserved)")
    seeded.sort()
    start = [(MALLOC, seed, size, stream) for _, seed, size, stream in seeded]
    ooms = [replace(oom, reserved_bytes=reserved_at_start + oom.reserved_bytes) for oom in ooms]
    return SnapshotTrace(
        operations=tuple(start + operations),
        device=device,
        events=len(events),
        from_empty=not seeded and reserved_at_start == 0,
        live_at_start=len(seeded),
        reserved_at_start_bytes=reserved_at_start,
        recorded_reserved_peak_bytes=reserved_at_start + peak,
        settings=settings_from_snapshot(snapshot.get("allocator_settings")),
        failed=ooms[-1] if ooms else None,
        released_mid_run=released_mid_run,
        survived=tuple(ooms[:-1]),
        operation_events=(-1,) * len(start) + tuple(operation_events),
    )


def settings_from_snapshot(recorded: object) -> AllocatorSettings | None:
    """The settings a snapshot's ``allocator_settings`` names (torch 2.3 and later); None where it names none.

    Its fields hold the settings in force; ``max_non_split_rounding_mb`` has no field and is read from the last
    configuration string it records (torch's ``last_allocator_settings``), 20 MiB where that string lacks it.

    >>> settings_from_snapshot({"expandable_segments": True, "max_split_size": -1}).conf()
    'expandable_segments:True'
    """
    if not isinstance(recorded, dict):
        return None
    max_split = recorded.get("max_split_size", -1)
    divisions = recorded.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and len(divisions) == ROUNDUP_INTERVALS:
        ordered = tuple(int(divisions[key]) for key in sorted(divisions, key=int))
    elif isinstance(divisions, list) and len(divisions) == ROUNDUP_INTERVALS:
        ordered = tuple(int(value) for value in divisions)
    else:
        ordered = DEFAULT_DIVISIONS
    threshold = recorded.get("garbage_collection_threshold") or None
    try:
        return AllocatorSettings(
            max_non_split_rounding_bytes=_non_split_rounding(recorded.get("PYTORCH_CUDA_ALLOC_CONF")),
            expandable_segments=bool(recorded.get("expandable_segments", False)),
            max_split_size_bytes=None
            if not isinstance(max_split, int) or max_split < 0 or max_split >= 2**63 - 1
            else max_split,
            roundup_power2_divisions=ordered,
            garbage_collection_threshold=float(threshold) if threshold else None,
        )
    except (ValueError, TypeError) as error:
        raise SnapshotError(f"not a memory snapshot (its allocator_settings are not torch's: {error})") from error


def _non_split_rounding(conf: object) -> int:
    """``max_non_split_rounding_mb`` from a recorded configuration string, in bytes; torch's default elsewhere."""
    if isinstance(conf, str) and "max_non_split_rounding_mb" in conf:
        try:
            return AllocatorSettings.from_conf(conf).max_non_split_rounding_bytes
        except ValueError:
            return LARGE_BUFFER_BYTES
    return LARGE_BUFFER_BYTES


@dataclass(frozen=True)
class Replay:
    """What the model held over a replayed trace, in bytes; ``out_of_memory`` where it ran out (the replay stops).

    ``out_of_memory_event``: the index in the device's trace of the request it ran out at (-1: a block live before
    the trace's first event); None where it did not run out.
    """

    settings: AllocatorSettings
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    alloc_retries: int
    out_of_memory: SimulatedOutOfMemory | None
    out_of_memory_event: int | None = None


def replay(
    trace: SnapshotTrace,
    settings: AllocatorSettings | None = None,
    capacity_bytes: int | None = None,
    serve_failed_request: bool = False,
) -> Replay:
    """Replay ``trace`` through the model with ``settings`` (the snapshot's own, else torch's defaults).

    ``serve_failed_request``: also ask for the request that ran out of memory in the recorded run (freed at once),
    to learn whether it would have been served at ``capacity_bytes``; off, the replay does what the recorded run did.
    """
    chosen = settings if settings is not None else (trace.settings or AllocatorSettings())
    model = CachingAllocatorModel(chosen, capacity_bytes)
    malloc, free = model.malloc, model.free
    failure: SimulatedOutOfMemory | None = None
    position = 0
    try:
        for position, (kind, block, size, stream) in enumerate(trace.operations):  # noqa: B007 -- read on failure
            if kind == MALLOC:
                malloc(block, size, stream)
            elif kind == FREE:
                free(block)
            elif serve_failed_request:
                malloc(block, size, stream)
                free(block)
    except SimulatedOutOfMemory as error:
        failure = error
    event = None if failure is None else trace.operation_events[position]
    return Replay(chosen, model.peak_allocated_bytes, model.peak_reserved_bytes, model.alloc_retries, failure, event)
