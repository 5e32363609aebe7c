"""The ``lightning-vram allocator`` command's output: a replayed snapshot as text or as JSON."""

from __future__ import annotations

from typing import Any

from lightning_vram.prediction.allocator.snapshot import FailedRequest, Replay
from lightning_vram.prediction.allocator.what_if import WhatIf
from lightning_vram.units import format_bytes


def _change(value: int, against: int) -> str:
    """``value`` beside ``against``: the difference in bytes and in percent."""
    difference = value - against
    share = f" ({difference / against:+.2%})" if against else ""
    return f"{'+' if difference >= 0 else '-'}{format_bytes(abs(difference))}{share}"


def _figures(replay: Replay) -> dict[str, Any]:
    return {
        "reserved_peak_bytes": replay.peak_reserved_bytes,
        "allocated_peak_bytes": replay.peak_allocated_bytes,
        "alloc_retries": replay.alloc_retries,
    }


def _judged(judged: Replay | None) -> dict[str, Any]:
    """``fits`` at the capacity judged at and, where it does not, the request it ran out at; nothing with none."""
    if judged is None:
        return {}
    failure = judged.out_of_memory
    if failure is None:
        return {"fits": True}
    return {
        "fits": False,
        "runs_out_at": {
            "event": judged.out_of_memory_event,
            "request_bytes": failure.requested_bytes,
            "allocated_bytes": failure.allocated_bytes,
            "reserved_bytes": failure.reserved_bytes,
        },
    }


def _out_of_memory(request: FailedRequest) -> dict[str, int]:
    return {
        "request_bytes": request.rounded_bytes,
        "capacity_bytes": request.capacity_bytes,
        "event": request.event,
    }


def allocator_dict(result: WhatIf) -> dict[str, Any]:
    """The JSON ``lightning-vram allocator --json`` prints: recorded, simulated and each alternative's figures.

    ``out_of_memory`` is the request the run ended on (the trace's last ``oom`` event; ``event``: its index in the
    trace), ``survived_out_of_memory`` the ones before it, which torch caught and the run went on from.
    ``capacity``: the capacity judged at (``bytes``; ``given``: asked for with ``--capacity``, else the run's);
    there, ``fits`` for the simulated run and each setting and, where one does not, ``runs_out_at``: the request it
    ran out at (``event``: its index in the trace, -1 for a block live before it; its size before rounding; the
    allocated and reserved bytes then).
    """
    trace = result.trace
    data: dict[str, Any] = {
        "recorded": {"reserved_peak_bytes": trace.recorded_reserved_peak_bytes},
        "simulated": {**_figures(result.simulated), "settings": result.simulated.settings.conf()},
        "what_if": [
            {"setting": alternative.setting, **_figures(alternative.replay), **_judged(alternative.judged)}
            for alternative in result.alternatives
        ],
        "trace": {
            "device": trace.device,
            "events": trace.events,
            "from_empty": trace.from_empty,
            "live_at_start": trace.live_at_start,
            "reserved_at_start_bytes": trace.reserved_at_start_bytes,
            "settings_recorded": trace.settings is not None,
            "segments_released_mid_run": trace.released_mid_run,
        },
    }
    data["simulated"].update(_judged(result.simulated_judged))
    if result.capacity_bytes is not None:
        data["capacity"] = {"bytes": result.capacity_bytes, "given": result.capacity_given}
    if trace.failed is not None:
        data["out_of_memory"] = _out_of_memory(trace.failed)
        data["survived_out_of_memory"] = [_out_of_memory(survived) for survived in trace.survived]
        if result.serving_failed is not None:
            data["simulated"]["reserved_peak_serving_failed_request_bytes"] = result.serving_failed.peak_reserved_bytes
    return data


def allocator_text(result: WhatIf) -> str:
    """The summary ``lightning-vram allocator`` prints, one figure a line."""
    trace = result.trace
    simulated = result.simulated
    recorded = trace.recorded_reserved_peak_bytes
    conf = simulated.settings.conf()
    settings = f'"{conf}"' + ("" if conf else " (torch's defaults)")  # as PYTORCH_ALLOC_CONF and the JSON hold it
    if trace.settings is None:
        settings += " (the snapshot does not say: torch's defaults assumed)"
    start = (
        "an empty device"
        if trace.from_empty
        else (
            f"mid-run: {trace.live_at_start} blocks live before its first event,"
            f" {format_bytes(trace.reserved_at_start_bytes)} reserved;"
            " the model starts from those blocks allocated afresh"
        )
    )
    lines = [
        f"trace: {trace.events} events{f' of device {trace.device}' if trace.device else ''} from {start}",
        f"allocator settings: {settings}",
        f"reserved peak: recorded {format_bytes(recorded)} ({recorded:,} B),"
        f" simulated {format_bytes(simulated.peak_reserved_bytes)} ({simulated.peak_reserved_bytes:,} B,"
        f" {_change(simulated.peak_reserved_bytes, recorded)})",
        f"allocated peak (simulated): {format_bytes(simulated.peak_allocated_bytes)}"
        f" ({simulated.peak_allocated_bytes:,} B)",
    ]
    if trace.failed is None and trace.released_mid_run:
        lines.append(
            f"the run met its device's memory: the allocator gave back {trace.released_mid_run} cached segment(s)"
            " before its last allocation (torch does when a cudaMalloc fails, then retries; or the code called"
            " torch.cuda.empty_cache()); these replays have no limit, so their reserved peaks can be above what that"
            " device let it hold"
        )
    against = simulated.peak_reserved_bytes
    if trace.failed is not None and result.serving_failed is not None:
        against = result.serving_failed.peak_reserved_bytes
        ended = f"the last of {len(trace.survived) + 1}, the one the run ended on: " if trace.survived else ""
        lines.append(
            f"out of memory at event {trace.failed.event} ({ended}a request of"
            f" {format_bytes(trace.failed.rounded_bytes)}) with"
            f" {format_bytes(trace.failed.capacity_bytes)} for the allocator (reserved + free);"
            f" serving it would need {format_bytes(against)} reserved ({against:,} B)"
            + ("" if result.capacity_given else f", simulated at that capacity: {_at(result.simulated_judged)}")
        )
        if trace.survived:
            lines.append(_survived(trace.survived))
    room = _room(result)
    serving = "serving the failed request too; " if trace.failed is not None else ""
    if result.capacity_given:
        lines.append(f"at {room}, with these settings ({serving}simulated): {_at(result.simulated_judged)}")
    if room is None:
        lines.append("what the allocator would have held with:")
    else:
        lines.append(
            f"what the allocator would have held with ({serving}the peaks with no limit, fits or out of memory"
            f" within {room}, its cache released and retried as torch does):"
        )
    width = max(len(alternative.setting) for alternative in result.alternatives)
    for alternative in result.alternatives:
        peak = alternative.replay.peak_reserved_bytes
        verdict = "" if alternative.judged is None else f"; {_at(alternative.judged)}"
        lines.append(
            f"  {alternative.setting:<{width}}  reserved peak {format_bytes(peak)} ({peak:,} B,"
            f" {_change(peak, against)} against these settings){verdict}"
        )
    last = _verdict(result)
    if last is not None:
        lines.append(last)
    return "\n".join(lines)


def _room(result: WhatIf) -> str | None:
    """The capacity judged at, in words: the one given or the run's; None where there is none."""
    if result.capacity_bytes is None:
        return None
    size = format_bytes(result.capacity_bytes)
    return f"the {size} given (--capacity)" if result.capacity_given else f"the {size} the run had"


def _at(judged: Replay | None) -> str:
    """A replay at the capacity judged at, in words: fits, or out of memory at which request."""
    failure = None if judged is None else judged.out_of_memory
    if judged is None or failure is None:
        return "fits"
    event = judged.out_of_memory_event
    where = "a block live before the trace" if event == -1 else f"event {event}"
    return (
        f"out of memory at {where} (a request of {format_bytes(failure.requested_bytes)},"
        f" {format_bytes(failure.allocated_bytes)} allocated)"
    )


def _survived(requests: tuple[FailedRequest, ...]) -> str:
    """The out-of-memory errors the run went on from, in one line: how many, at which events, of what sizes."""
    sizes = sorted(request.rounded_bytes for request in requests)
    span = format_bytes(sizes[0]) if sizes[0] == sizes[-1] else f"{format_bytes(sizes[0])} to {format_bytes(sizes[-1])}"
    events = ", ".join(str(request.event) for request in requests[:5]) + (", ..." if len(requests) > 5 else "")
    return (
        f"survived before it: {len(requests)} out-of-memory error(s) torch caught and the run went on from (at events"
        f" {events}; requests of {span}; cuDNN does, falling back to a convolution algorithm with less workspace):"
        " the run did not need that memory, and they are not replayed"
    )


def _verdict(result: WhatIf) -> str | None:
    """The answer to "would this run have fit, or with which allocator setting?", at the capacity judged at.

    Only the trace is known: the run up to its failed request, that request included; later steps are not in it.
    None where there is no capacity to judge at.
    """
    if result.capacity_bytes is None:
        return None
    size = format_bytes(result.capacity_bytes)
    room = f"the {size} given (--capacity)" if result.capacity_given else f"the same {size}"
    failed = result.trace.failed is not None
    what = "the failed request" if failed else "the whole trace"
    known = "simulated; the trace ends there" if failed else "simulated over the trace"
    if result.capacity_given and result.simulated_fits:
        return f"with these settings, would have served {what} in {room} ({known})"
    saving = [alternative for alternative in result.alternatives if alternative.fits]
    if not saving:
        return (
            f"no setting tried serves {what} in {room}: the step itself must hold less"
            " (a smaller batch, 16-bit precision, activation checkpointing)"
        )
    names = ", ".join(alternative.setting for alternative in saving)
    return (
        f"would have served {what} in {room} ({known}): {names};"
        f" for example PYTORCH_CUDA_ALLOC_CONF={saving[0].replay.settings.conf()} python train.py"
    )
