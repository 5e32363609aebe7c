"""The fit table's search memo (:class:`ServingMemo`) answers every serving as :func:`serve` does: its key holds the
settings, the batch, the capacity and the unseen bytes, and a step served below a capacity is reused above it only
without expandable segments (there the capacity sizes the address space, and with it which block is taken)."""

from __future__ import annotations

import random
from dataclasses import replace

from allocator_traces import load

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.replay.serves import ServingMemo, serve
from lightning_vram.records import AllocationSequence, Phase

MIB = 1024**2


def _step(batch: int) -> AllocationSequence:
    """A step whose frees leave holes: sizes grow with ``batch``, every third block is kept to the end."""
    events: list[object] = [Phase.FORWARD]
    for block in range(40):
        events.append(("malloc", block, (block % 7 + 1) * batch * 2_000_000 + 512 * block, 0))
        if block % 3:
            events.append(("free", block, 0, 0))
    events.append(Phase.BACKWARD)
    events.extend(("malloc", 100 + block, (block % 5 + 2) * batch * 900_000, 0) for block in range(12))
    return tuple(events)  # type: ignore[return-value]


def test_the_memo_serves_as_serve_does_and_keys_on_settings_batch_capacity_and_unseen_bytes() -> None:
    settings = (
        AllocatorSettings(),
        AllocatorSettings(expandable_segments=True),
        AllocatorSettings.from_conf("max_split_size_mb:24"),
    )
    unseen = ({}, {Phase.FORWARD: 30 * MIB, Phase.BACKWARD: 3 * MIB})
    steps = {batch: _step(batch) for batch in (1, 2, 3)}
    peaks = [serve(step, AllocatorSettings(), 1 << 45).reserved_peak_bytes for step in steps.values()]
    capacities = sorted({int(peak * share) for peak in peaks for share in (0.8, 1.0, 1.1, 1.5)})
    calls = [
        (batch, chosen, capacity, hidden)
        for batch in steps
        for chosen in settings
        for hidden in unseen
        for capacity in capacities
    ]
    random.Random(0).shuffle(calls)
    memo = ServingMemo()
    outcomes = set()
    for batch, chosen, capacity, hidden in calls:
        expected = serve(steps[batch], chosen, capacity, hidden)
        assert memo.serve(batch, steps[batch], chosen, capacity, hidden) == expected
        outcomes.add((expected.reserved_peak_bytes, expected.served))
    assert len(outcomes) > 20  # the calls differ: a key short of one part would answer one with another's serving
    simulated = memo.simulations
    assert simulated < len(calls)  # and the memo spared some
    for batch, chosen, capacity, hidden in calls:  # asked again: every answer from the memo, none simulated
        expected = serve(steps[batch], chosen, capacity, hidden)
        assert memo.serve(batch, steps[batch], chosen, capacity, hidden) == expected
    assert memo.simulations == simulated


def test_a_step_served_with_expandable_segments_is_simulated_again_at_a_larger_capacity() -> None:
    # ResNet-50's recorded step 0 with expandable segments: served at its peak and at 1.1 times it, where a cached
    # block at the end of a larger address space counts larger, another block is taken and the peak is higher.
    snapshot, _ = load("resnet50-b64")
    live: dict[int, int] = {}
    sequence: list[tuple[str, int, int, int]] = []
    for block, event in enumerate(snapshot["device_traces"][0]):
        if event["action"] == "alloc":
            live[event["addr"]] = block
            sequence.append(("malloc", block, event["size"], event["stream"]))
        elif event["action"] == "free_completed":
            sequence.append(("free", live.pop(event["addr"]), 0, 0))
    step = tuple(sequence)
    expandable = replace(AllocatorSettings(), expandable_segments=True)
    peak = serve(step, expandable, 1 << 45).reserved_peak_bytes
    memo = ServingMemo()
    assert memo.serve(0, step, expandable, peak, {}) == serve(step, expandable, peak)
    larger = serve(step, expandable, int(peak * 1.1))
    assert larger.served and larger.reserved_peak_bytes > peak
    assert memo.serve(0, step, expandable, int(peak * 1.1), {}) == larger
