"""The caching allocator model: torch's rules on hand-derived byte counts, and the recorded GPU traces replayed.

The traces (tests/data/gpu-traces, recorded on an H200 with torch 2.11) carry the allocator's own per-phase peaks;
``pytest -s`` prints them beside the model's.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from allocator_traces import MONITORED, NAMES, SHIPPED, SNAPSHOTS, capacity, load, monitored, replay_phases

from lightning_vram.prediction.allocator.model import CachingAllocatorModel, SimulatedOutOfMemory
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.allocator.snapshot import (
    SnapshotError,
    SnapshotTrace,
    read_snapshot,
    replay,
    settings_from_snapshot,
    trace_from_snapshot,
)

KIB = 1024
MIB = 1024 * 1024
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def trace(name: str) -> SnapshotTrace:
    return trace_from_snapshot(read_snapshot(SNAPSHOTS[name]))


# torch's rules, byte counts derived by hand


@pytest.mark.parametrize(
    ("conf", "size", "rounded"),
    [
        ("", 1, 512),
        ("", 512, 512),
        ("", 513, 1024),
        ("", 3 * MIB + 1, 3 * MIB + 512),
        # 4 divisions between 1 MiB and 2 MiB: steps of 256 KiB.
        ("roundup_power2_divisions:4", 1_300_000, MIB + 256 * KIB),
        ("roundup_power2_divisions:4", 2 * MIB, 2 * MIB),
        # at or below 512 B x divisions, only the 512-byte rounding
        ("roundup_power2_divisions:4", 1500, 1536),
        # divisions for 256 MiB and more only: a 300 MiB request goes to 320 MiB (steps of 64 MiB above 256).
        ("roundup_power2_divisions:[128:1,>:4]", 300 * MIB + 1, 320 * MIB),
        ("roundup_power2_divisions:[128:1,>:4]", 100 * MIB + 1, 100 * MIB + 512),
    ],
)
def test_rounding(conf: str, size: int, rounded: int) -> None:
    assert CachingAllocatorModel(AllocatorSettings.from_conf(conf)).round_size(size) == rounded


def test_small_pool_packs_two_mib_segments() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 1000)
    assert (model.allocated_bytes, model.reserved_bytes, model.segments) == (1024, 2 * MIB, 1)
    model.malloc(2, MIB)  # 1 MiB is still small: the rest of the first segment holds it
    assert (model.allocated_bytes, model.reserved_bytes) == (MIB + 1024, 2 * MIB)
    model.malloc(3, MIB)  # 2 MiB - 1 MiB - 1 KiB left: a second segment
    assert (model.allocated_bytes, model.reserved_bytes, model.segments) == (2 * MIB + 1024, 4 * MIB, 2)


def test_large_pool_segments_and_the_split_at_one_mib() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 3 * MIB)  # under 10 MiB: a 20 MiB segment, split (17 MiB remain)
    assert (model.allocated_bytes, model.reserved_bytes) == (3 * MIB, 20 * MIB)
    model.malloc(2, 15 * MIB + 512 * KIB)  # takes the 17 MiB block, split: 1.5 MiB > 1 MiB remains
    assert (model.allocated_bytes, model.reserved_bytes) == (18 * MIB + 512 * KIB, 20 * MIB)
    model.free(2)
    model.malloc(3, 16 * MIB + 512 * KIB)  # 0.5 MiB would remain: the whole 17 MiB block is handed out
    assert (model.allocated_bytes, model.reserved_bytes) == (20 * MIB, 20 * MIB)
    model.malloc(4, 11 * MIB + 1)  # 10 MiB or more: a segment of the request rounded up to 2 MiB, 12 MiB; the
    # rest, 1 MiB - 512 B, is not more than 1 MiB: the block is the whole segment
    assert (model.allocated_bytes, model.reserved_bytes, model.segments) == (32 * MIB, 32 * MIB, 2)


def test_best_fit_takes_the_smallest_block_that_holds_the_request() -> None:
    model = CachingAllocatorModel()
    for block, size in ((1, 30 * MIB), (2, 40 * MIB), (3, 12 * MIB)):
        model.malloc(block, size)
    model.free(2)
    model.free(1)
    model.malloc(4, 29 * MIB)  # the 30 MiB block (1 MiB left: handed out whole), not the 40 MiB one
    assert model.allocated_bytes == (12 + 30) * MIB
    model.malloc(5, 30 * MIB)  # only the 40 MiB block holds it: split, 10 MiB stay cached
    assert (model.allocated_bytes, model.reserved_bytes) == (72 * MIB, 82 * MIB)


def test_freed_blocks_merge_so_the_segment_can_be_released() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 3 * MIB)
    model.malloc(2, 3 * MIB)  # both in one 20 MiB segment
    model.free(1)
    model.empty_cache()  # block 2 is in use: the segment stays
    assert (model.reserved_bytes, model.segments) == (20 * MIB, 1)
    model.free(2)  # merges with the free 3 MiB before it and the 14 MiB after it: the whole segment
    model.empty_cache()
    assert (model.allocated_bytes, model.reserved_bytes, model.segments) == (0, 0, 0)


def test_max_split_size_keeps_oversize_blocks_whole_and_for_oversize_requests() -> None:
    model = CachingAllocatorModel(AllocatorSettings.from_conf("max_split_size_mb:64"))
    model.malloc(1, 100 * MIB)
    model.free(1)
    model.malloc(2, 30 * MIB)  # under 64 MiB: the cached 100 MiB block is not for it, a new 30 MiB segment
    assert (model.allocated_bytes, model.reserved_bytes) == (30 * MIB, 130 * MIB)
    model.malloc(3, 70 * MIB)  # oversize, but the 100 MiB block is 20 MiB or more larger: a new segment
    assert (model.allocated_bytes, model.reserved_bytes) == (100 * MIB, 200 * MIB)
    model.malloc(4, 90 * MIB)  # within 20 MiB of the 100 MiB block: handed out whole, never split
    assert (model.allocated_bytes, model.reserved_bytes) == (200 * MIB, 200 * MIB)


def test_expandable_segments_map_pages_where_the_request_fits() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    model.malloc(1, 3 * MIB)  # one 20 MiB page of the large pool's segment; the 17 MiB rest stays free
    assert (model.allocated_bytes, model.reserved_bytes, model.segments) == (3 * MIB, 20 * MIB, 0)
    model.malloc(2, 30 * MIB)  # the free 17 MiB and one more page: 37 MiB, split (any rest of 512 B or more)
    assert (model.allocated_bytes, model.reserved_bytes) == (33 * MIB, 40 * MIB)
    model.malloc(3, 1000)  # the small pool's own segment: one 2 MiB page
    assert model.reserved_bytes == 42 * MIB
    model.free(1)
    model.empty_cache()  # 3 MiB free in the first page: no whole page to unmap
    assert model.reserved_bytes == 42 * MIB
    model.free(2)  # the whole 40 MiB is free now
    model.empty_cache()
    assert (model.allocated_bytes, model.reserved_bytes) == (1024, 2 * MIB)
    assert (model.device_allocs, model.device_frees) == (3, 1)


def test_release_and_retry_at_the_capacity_then_out_of_memory() -> None:
    model = CachingAllocatorModel(capacity_bytes=40 * MIB)
    model.malloc(1, 20 * MIB)
    model.free(1)  # 20 MiB cached
    model.malloc(2, 30 * MIB)  # 20 + 30 > 40: the cached segment is released, and the request asked again
    assert (model.reserved_bytes, model.peak_reserved_bytes, model.alloc_retries) == (30 * MIB, 30 * MIB, 1)
    with pytest.raises(SimulatedOutOfMemory) as raised:
        model.malloc(3, 20 * MIB)  # nothing cached to release: out of memory
    error = raised.value
    assert (error.requested_bytes, error.allocation_bytes) == (20 * MIB, 20 * MIB)
    assert (error.allocated_bytes, error.reserved_bytes, error.capacity_bytes) == (30 * MIB, 30 * MIB, 40 * MIB)
    assert model.alloc_retries == 2


def test_max_split_size_releases_only_the_oversize_block_it_needs() -> None:
    model = CachingAllocatorModel(AllocatorSettings.from_conf("max_split_size_mb:64"), capacity_bytes=200 * MIB)
    model.malloc(1, 150 * MIB)
    model.malloc(2, 40 * MIB)
    model.free(1)
    model.malloc(3, 120 * MIB)  # 190 + 120 > 200: the cached 150 MiB block alone is freed, no retry counted
    assert (model.reserved_bytes, model.alloc_retries) == (160 * MIB, 0)


def test_garbage_collection_frees_the_oldest_cached_segments_under_a_memory_fraction() -> None:
    settings = AllocatorSettings.from_conf("garbage_collection_threshold:0.5")
    collected = CachingAllocatorModel(settings, memory_fraction_bytes=100 * MIB)
    plain = CachingAllocatorModel(AllocatorSettings(), memory_fraction_bytes=100 * MIB)
    for model in (collected, plain):
        model.malloc(1, 30 * MIB)
        model.free(1)  # cached at search 1
        model.malloc(2, 40 * MIB)  # search 2: no block; 30 MiB held, under the 50 MiB threshold: a new segment
        model.free(2)  # cached at search 2
        model.malloc(3, 44 * MIB)  # search 3: no block of 44 MiB
    # Collected: 70 MiB held, 20 over the threshold; ages 2 (30 MiB) and 1 (40 MiB), average 1.5: the 30 MiB
    # segment goes, and the 44 MiB one fits beside the 40 MiB still cached (84 <= 100).
    assert (collected.reserved_bytes, collected.alloc_retries) == (84 * MIB, 0)
    # Without the threshold: 70 + 44 > 100, so the whole cache is released and the request retried.
    assert (plain.reserved_bytes, plain.alloc_retries) == (44 * MIB, 1)
    # The threshold alone does nothing (torch acts on it only with a memory fraction set).
    alone = CachingAllocatorModel(settings)
    alone.malloc(1, 30 * MIB)
    alone.free(1)
    alone.malloc(2, 40 * MIB)
    assert alone.reserved_bytes == 70 * MIB


def test_peaks_restart_from_the_current_values() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 30 * MIB)
    model.free(1)
    model.reset_peaks()
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == (0, 30 * MIB)


def test_bad_calls_name_what_is_wrong() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 0)  # torch allocates nothing for 0 bytes
    assert model.reserved_bytes == 0
    with pytest.raises(ValueError, match="block 1 is already allocated"):
        model.malloc(1, 10)
    with pytest.raises(ValueError, match="block 2 is not allocated"):
        model.free(2)
    with pytest.raises(ValueError, match="capacity_bytes must be a positive number of bytes or None, got 0"):
        CachingAllocatorModel(capacity_bytes=0)


# settings, as torch reads them


def test_settings_from_conf() -> None:
    settings = AllocatorSettings.from_conf(
        " expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6"
    )
    assert settings.expandable_segments and settings.max_split_size_bytes == 128 * MIB
    assert settings.garbage_collection_threshold == 0.6
    # torch: the first listed interval fills the ones below it, '>' fills from the last listed interval up.
    listed = AllocatorSettings.from_conf("roundup_power2_divisions:[256:1,512:2,>:4]").roundup_power2_divisions
    assert listed == (1,) * 9 + (4,) * 7
    assert AllocatorSettings.from_conf("roundup_power2_divisions:8").roundup_power2_divisions == (8,) * 16
    assert AllocatorSettings.from_conf("").conf() == ""
    for conf in (
        "expandable_segments:True,max_split_size_mb:256",
        "roundup_power2_divisions:[1:2,2:4,4:4,8:4,16:4,32:4,64:4,128:4,256:4,512:4,1024:4,2048:4,4096:4,8192:4,16384:4,32768:4]",
    ):
        assert AllocatorSettings.from_conf(AllocatorSettings.from_conf(conf).conf()) == AllocatorSettings.from_conf(
            conf
        )


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ("max_split_size_mb:20", "max_split_size_mb must be above 20, got 20"),
        ("max_split_size_mb:big", "max_split_size_mb must be an integer, got 'big'"),
        ("expandable_segments:yes", "expandable_segments must be True or False, got 'yes'"),
        ("expandable_segments", "'expandable_segments' needs a value"),
        ("compact_everything:True", "unrecognized allocator option 'compact_everything'"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of two, got 3"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold must be in (0, 1)"),
    ],
)
def test_bad_conf_names_the_key(conf: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AllocatorSettings.from_conf(conf)


def test_settings_from_the_environment_as_torch_reads_them() -> None:
    both = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorSettings.from_environment(both).conf() == "max_split_size_mb:128"  # torch 2.9+: the new name wins
    assert AllocatorSettings.from_environment({**both, "PYTORCH_ALLOC_CONF": ""}).conf() == ""  # set, even empty
    cuda_only = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert AllocatorSettings.from_environment(cuda_only).expandable_segments
    assert AllocatorSettings.from_environment({}) == AllocatorSettings()


# the recorded traces


def print_table(name: str, rows: list) -> None:  # type: ignore[type-arg]
    print(f"\n{name}: step phase | reserved peak recorded / simulated | allocated peak recorded / simulated")
    for row in rows:
        print(
            f"  {row.step} {row.phase:<9} | {row.recorded_reserved:>15,} {row.simulated_reserved:>15,}"
            f" {row.simulated_reserved - row.recorded_reserved:>+11,} | {row.recorded_allocated:>15,}"
            f" {row.simulated_allocated:>15,} {row.simulated_allocated - row.recorded_allocated:>+11,}"
        )


@pytest.mark.parametrize("name", NAMES)
def test_each_trace_replays_to_the_allocators_peaks_per_phase(name: str) -> None:
    rows = replay_phases(name)
    print_table(name, rows)
    assert len(rows) == 3 * len(load(name)[1]["truth"])
    # The bar is 1% per phase; the project's own traces replay to the byte (their segment events are exact),
    # but for the one whose addresses came in the other order (MONITORED).
    exact = name in SHIPPED and name not in MONITORED
    tolerance = 1e-3 if exact else 1e-2
    for row in rows:
        assert row.simulated_reserved == pytest.approx(row.recorded_reserved, rel=tolerance), row
        if not monitored(name):  # the monitor reset the allocated peak just before the run read it
            assert row.simulated_allocated == pytest.approx(row.recorded_allocated, rel=tolerance), row
    if exact:
        assert all(row.simulated_reserved == row.recorded_reserved for row in rows)


def test_the_projects_traces_are_all_found() -> None:
    assert set(SHIPPED) <= set(NAMES) and all(SNAPSHOTS[name].is_file() for name in SHIPPED)


@pytest.mark.parametrize("name", NAMES)
def test_the_command_figures_match_the_recorded_peak(name: str) -> None:
    recorded = trace(name)
    _, measured = load(name)
    assert recorded.from_empty and recorded.reserved_at_start_bytes == 0
    # A run that ran out of memory in its first step has no phase measured: its own reading at the end.
    largest = max(
        (phase["reserved_peak"] for step in measured["truth"] for phase in step.values() if isinstance(phase, dict)),
        default=measured.get("reserved_peak"),
    )
    assert recorded.recorded_reserved_peak_bytes == largest
    # At the capacity the run had, where it gives one (the allocator released its cache and retried there); the
    # trace whose addresses came in the other order (MONITORED) and traces from outside the project (issue 24: the
    # hidden traces hold too) within 1%.
    simulated = replay(recorded, capacity_bytes=capacity(name)).peak_reserved_bytes
    exact = name in SHIPPED and name not in MONITORED
    assert simulated == (largest if exact else pytest.approx(largest, rel=1e-2))


def test_expandable_segments_hold_less_for_the_same_trace() -> None:
    # The README's 144.2 GB (default) against 129.9 GB (expandable segments), each recorded at batch 150:
    # the default trace replayed with expandable segments holds what the expandable run recorded.
    default = trace("gpt2-b150")
    expandable = trace("gpt2-b150-expandable")
    assert default.settings == AllocatorSettings() and expandable.settings == EXPANDABLE
    assert replay(default, EXPANDABLE).peak_reserved_bytes == expandable.recorded_reserved_peak_bytes
    assert replay(expandable, AllocatorSettings()).peak_reserved_bytes == default.recorded_reserved_peak_bytes


@pytest.mark.parametrize("name", NAMES)
def test_each_trace_fits_at_its_recorded_reserved_peak(name: str) -> None:
    recorded = trace(name)
    result = replay(recorded, capacity_bytes=recorded.recorded_reserved_peak_bytes)
    assert result.out_of_memory is None
    # A run at its device's capacity released its cache and retried to stay there; the others never had to.
    assert result.alloc_retries == 0 or capacity(name) is not None


@pytest.mark.parametrize("name", [name for name in NAMES if capacity(name) is not None])
def test_a_trace_at_capacity_runs_out_of_memory_in_the_model_where_the_run_did(name: str) -> None:
    recorded = trace(name)
    available = capacity(name)
    served = replay(recorded, capacity_bytes=available)
    assert served.out_of_memory is None  # every request the run was served
    if recorded.failed is None:
        return
    # The request that failed, where the run ran out: the allocator held what its capacity (the device's free
    # memory at the start, as the oom event's own figures say) allowed, released its cache, and could not serve it.
    # In two runs of the H100's second gpu_check (not shipped) the oom event's figures give 2 MiB less than was free
    # at the start: memory taken outside the allocator during the run (a library's own, or lazily loaded kernels).
    at_failure = recorded.failed.capacity_bytes
    outside = available - at_failure
    assert outside == 0 if name in SHIPPED else 0 <= outside <= 0.001 * available
    failing = replay(recorded, capacity_bytes=at_failure, serve_failed_request=True).out_of_memory
    assert failing is not None and failing.capacity_bytes == at_failure
    assert failing.requested_bytes == recorded.failed.rounded_bytes


def test_which_runs_fit_where() -> None:
    default = trace("gpt2-b150")
    allocated_peak = replay(default).peak_allocated_bytes
    expandable_peak = trace("gpt2-b150-expandable").recorded_reserved_peak_bytes
    below = replay(default, capacity_bytes=allocated_peak - 2 * MIB).out_of_memory
    assert below is not None and below.capacity_bytes == allocated_peak - 2 * MIB
    # Where expandable segments serve the whole trace, the default allocator runs out of memory, even after
    # releasing its cache and retrying: a request of 15,438,950,400 B finds no free segment large enough.
    at_expandable = replay(default, capacity_bytes=expandable_peak)
    assert at_expandable.out_of_memory is not None and at_expandable.alloc_retries == 1
    assert at_expandable.out_of_memory.requested_bytes == 15_438_950_400
    assert replay(default, EXPANDABLE, capacity_bytes=expandable_peak).out_of_memory is None
    # Releasing free pages lets expandable segments fit below their own uncapped peak, and never above it.
    tight = replay(default, EXPANDABLE, capacity_bytes=expandable_peak - 256 * MIB)
    assert tight.out_of_memory is None and tight.peak_reserved_bytes <= expandable_peak - 256 * MIB


# snapshots that are not from an empty device, or not snapshots


def test_the_settings_a_snapshot_recorded() -> None:
    recorded = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256,max_non_split_rounding_mb:64,roundup_power2_divisions:4",
        "max_split_size": 256 * MIB,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": False,
        "roundup_power2_divisions": {str(1 << index): 4 for index in range(16)},
    }
    settings = settings_from_snapshot(recorded)
    assert settings == AllocatorSettings.from_conf(recorded["PYTORCH_CUDA_ALLOC_CONF"])  # type: ignore[arg-type]
    assert settings_from_snapshot(None) is None  # before torch 2.3 snapshots do not say


def test_a_trace_that_starts_mid_run_starts_from_its_live_blocks() -> None:
    snapshot, _ = load("gpt2-b8")
    events = snapshot["device_traces"][0]
    cut = len(events) // 2
    live: set[int] = set()
    reserved = 0
    for event in events[:cut]:
        if event["action"] == "alloc":
            live.add(event["addr"])
        elif event["action"] == "free_completed":
            live.discard(event["addr"])
        elif event["action"] == "segment_alloc":
            reserved += event["size"]
        elif event["action"] == "segment_free":
            reserved -= event["size"]
    tail = {**snapshot, "device_traces": [events[cut:]]}  # the end state is the same: segments were all freed
    partial = trace_from_snapshot(tail)
    assert not partial.from_empty
    assert (partial.live_at_start, partial.reserved_at_start_bytes) == (len(live), reserved)
    result = replay(partial)
    assert result.out_of_memory is None and result.peak_allocated_bytes > 0


def test_an_out_of_memory_trace_knows_its_capacity() -> None:
    events = [
        {"action": "segment_alloc", "addr": 1 << 30, "size": 20 * MIB, "stream": 0},
        {"action": "alloc", "addr": 1 << 30, "size": 3 * MIB, "stream": 0},
        {"action": "oom", "addr": 25 * MIB, "size": 30 * MIB, "stream": 0},
    ]
    blocks = [{"size": 3 * MIB, "requested_size": 3 * MIB, "state": "active_allocated"}]
    blocks.append({"size": 17 * MIB, "requested_size": 0, "state": "inactive"})
    segment = {"device": 0, "address": 1 << 30, "total_size": 20 * MIB, "stream": 0, "blocks": blocks}
    failed = trace_from_snapshot({"segments": [segment], "device_traces": [events]})
    assert failed.from_empty and failed.failed is not None and failed.failed.capacity_bytes == 45 * MIB
    # Default: 20 MiB held (3 MiB of it in use, so it cannot be released) + a 30 MiB segment > 45 MiB.
    assert replay(failed, capacity_bytes=45 * MIB, serve_failed_request=True).out_of_memory is not None
    # Expandable: the 17 MiB free and one more 20 MiB page hold it, 40 MiB in all.
    assert replay(failed, EXPANDABLE, capacity_bytes=45 * MIB, serve_failed_request=True).out_of_memory is None


def test_the_first_device_with_a_trace_is_read() -> None:
    snapshot, _ = load("resnet50-b64")
    second = {**snapshot, "device_traces": [[], snapshot["device_traces"][0]]}
    found = trace_from_snapshot(second)
    assert found.device == 1 and found.events == len(snapshot["device_traces"][0])
    assert replay(found).peak_reserved_bytes == trace("resnet50-b64").recorded_reserved_peak_bytes
    with pytest.raises(SnapshotError, match="no allocation trace in this snapshot"):
        trace_from_snapshot(second, device=0)


def test_a_file_that_names_any_class_is_not_unpickled(tmp_path: Path) -> None:
    hostile = tmp_path / "hostile.pickle"
    hostile.write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "ran").encode() + b"'\ntR.")
    with pytest.raises(SnapshotError, match=r"not a memory snapshot \(it names os.system\)"):
        read_snapshot(hostile)
    assert not (tmp_path / "ran").exists()
    plain = tmp_path / "plain.pickle"
    plain.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    with pytest.raises(SnapshotError, match="no allocation trace in this snapshot"):
        trace_from_snapshot(read_snapshot(plain))
