"""``lightning-vram allocator SNAPSHOT``: the recorded traces replayed, and files that are not snapshots."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from allocator_traces import NAMES, SHIPPED, SNAPSHOTS, capacity, load, run_settings

from lightning_vram.cli import main
from lightning_vram.prediction.allocator.snapshot import read_snapshot, trace_from_snapshot
from lightning_vram.units import format_bytes

MIB = 1024 * 1024


def recorded_peak(name: str) -> int:
    """The largest reserved peak the allocator itself reported over the run's phases."""
    _, measured = load(name)
    return max(
        step[phase]["reserved_peak"] for step in measured["truth"] for phase in ("forward", "backward", "optimizer")
    )


UNCAPPED = tuple(name for name in NAMES if capacity(name) is None)
"""The traces whose runs stayed clear of their device's capacity: the command, which knows no capacity, replays them
as they ran."""


@pytest.mark.parametrize("name", UNCAPPED)
def test_json_gives_the_recorded_and_simulated_peaks(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["allocator", "--json", str(SNAPSHOTS[name])]) == 0
    data = json.loads(capsys.readouterr().out)
    peak = recorded_peak(name)
    assert data["recorded"] == {"reserved_peak_bytes": peak}
    assert data["simulated"]["reserved_peak_bytes"] == peak
    expandable = run_settings(name).expandable_segments
    assert data["simulated"]["settings"] == run_settings(name).conf()
    settings = [entry["setting"] for entry in data["what_if"]]
    assert settings == [
        f"expandable_segments:{not expandable}",
        "max_split_size_mb:64",
        "max_split_size_mb:128",
        "max_split_size_mb:256",
        "max_split_size_mb:512",
    ]
    assert all(entry["reserved_peak_bytes"] >= entry["allocated_peak_bytes"] > 0 for entry in data["what_if"])
    assert data["trace"]["from_empty"] and "out_of_memory" not in data


def served_status(data: dict[str, Any]) -> int:
    """The exit status the command owes its JSON: 1 where a capacity is judged and no setting serves the run there."""
    verdicts = [data["simulated"].get("fits"), *(entry.get("fits") for entry in data["what_if"])]
    return 1 if data["capacity"] is not None and not any(verdicts) else 0


def _ran_out(name: str) -> bool:
    return any(event["action"] == "oom" for event in load(name)[0]["device_traces"][0])


@pytest.mark.parametrize("name", [name for name in NAMES if _ran_out(name)])
def test_a_recorded_run_that_ran_out_of_memory_does_in_the_command_too(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["allocator", "--json", str(SNAPSHOTS[name])])
    data = json.loads(capsys.readouterr().out)
    assert status == served_status(data)  # 1: no setting would have saved the run (GPT-2 at 96 on the H100)
    assert name != "h100-gpt2-b96" or status == 1
    # The capacity the oom event's own figures give is what the device had free when the run began. The run ended on
    # the last oom event; torch caught the earlier ones (ResNet-50's cuDNN workspaces) and the run went on.
    events = load(name)[0]["device_traces"][0]
    *survived, failed = [index for index, event in enumerate(events) if event["action"] == "oom"]
    at_failure = trace_from_snapshot(read_snapshot(SNAPSHOTS[name])).failed
    assert at_failure is not None
    assert data["out_of_memory"] == {
        "request_bytes": events[failed]["size"],
        "capacity_bytes": at_failure.capacity_bytes,
        "event": failed,
    }
    # What the device had free as the run began, for the traces this project keeps (see test_allocator_model.py).
    assert name not in SHIPPED or at_failure.capacity_bytes == capacity(name)
    assert [entry["event"] for entry in data["survived_out_of_memory"]] == survived
    assert [entry["request_bytes"] for entry in data["survived_out_of_memory"]] == [events[i]["size"] for i in survived]
    assert data["simulated"]["fits"] is False


def test_the_default_run_learns_what_expandable_segments_hold(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["allocator", "--json", str(SNAPSHOTS["gpt2-b150"])]) == 0
    expandable = json.loads(capsys.readouterr().out)["what_if"][0]
    assert expandable["setting"] == "expandable_segments:True"
    assert expandable["reserved_peak_bytes"] == recorded_peak("gpt2-b150-expandable")  # the expandable run's own


def test_text_names_each_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["allocator", str(SNAPSHOTS["gpt2-b8"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    peak = recorded_peak("gpt2-b8")
    assert lines[0] == f"trace: {len(load('gpt2-b8')[0]['device_traces'][0])} events from an empty device"
    assert lines[1] == 'allocator settings: "" (torch\'s defaults)'
    assert lines[2] == (
        f"reserved peak: recorded {format_bytes(peak)} ({peak:,} B), simulated {format_bytes(peak)} ({peak:,} B,"
        " +0 B (+0.00%))"
    )
    assert lines[5].startswith("  expandable_segments:True  reserved peak ")


def test_an_out_of_memory_snapshot_says_which_settings_would_have_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [
        {"action": "segment_alloc", "addr": 1 << 30, "size": 20 * MIB, "stream": 0},
        {"action": "alloc", "addr": 1 << 30, "size": 3 * MIB, "stream": 0},
        {"action": "oom", "addr": 25 * MIB, "size": 30 * MIB, "stream": 0},
    ]
    blocks = [{"size": 3 * MIB, "state": "active_allocated"}, {"size": 17 * MIB, "state": "inactive"}]
    segment = {"device": 0, "address": 1 << 30, "total_size": 20 * MIB, "stream": 0, "blocks": blocks}
    path = tmp_path / "vram_oom_snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment], "device_traces": [events]}))
    assert main(["allocator", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["out_of_memory"] == {"request_bytes": 30 * MIB, "capacity_bytes": 45 * MIB, "event": 2}
    assert data["survived_out_of_memory"] == []
    assert data["simulated"]["fits"] is False
    # Serving the failed request: 20 MiB held (3 MiB in use) + a new 30 MiB segment with the defaults; expandable
    # segments map one more 20 MiB page after the free 17 MiB, 40 MiB in all, within the 45 MiB the run had.
    assert data["simulated"]["reserved_peak_serving_failed_request_bytes"] == 50 * MIB
    assert data["what_if"][0] == {
        "setting": "expandable_segments:True",
        "reserved_peak_bytes": 40 * MIB,
        "allocated_peak_bytes": 33 * MIB,
        "alloc_retries": 0,
        "fits": True,
    }
    assert main(["allocator", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(the snapshot does not say: torch's defaults assumed)" in out
    assert "serving it would need 50.0 MiB reserved (52,428,800 B), simulated at that capacity: out of memory" in out
    assert "  expandable_segments:True  reserved peak 40.0 MiB (41,943,040 B, -10.0 MiB (-20.00%)" in out


def with_survived_ooms(name: str, directory: Path) -> tuple[Path, list[int]]:
    """The trace ``name`` with two ``oom`` events added before its own, as torch records one it caught (cuDNN trying
    a convolution algorithm whose workspace does not fit, then one needing less): 40 GiB asked for, the device's free
    bytes of the run's own oom event; and the indices of the added events."""
    snapshot, _ = load(name)
    events = snapshot["device_traces"][0]
    fatal = next(event for event in events if event["action"] == "oom")
    added = [500, 901]  # their indices once inserted, both before the run's own oom event
    for index in added:
        events.insert(index, {**fatal, "size": 40 * 1024**3})
    path = directory / f"{name}-survived.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    return path, added


def test_the_oom_the_run_ended_on_is_judged_and_the_earlier_ones_are_survived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, added = with_survived_ooms("h100-gpt2-b96", tmp_path)
    assert main(["allocator", "--json", str(SNAPSHOTS["h100-gpt2-b96"])]) == 1  # no setting serves it
    alone = json.loads(capsys.readouterr().out)
    assert main(["allocator", "--json", str(path)]) == 1
    data = json.loads(capsys.readouterr().out)
    # Judged as the same run without the caught errors: the same failed request, capacity, replays and verdicts.
    survived = data.pop("survived_out_of_memory")
    assert [(entry["event"], entry["request_bytes"]) for entry in survived] == [
        (index, 40 * 1024**3) for index in added
    ]
    assert data["out_of_memory"].pop("event") == alone["out_of_memory"].pop("event") + 2
    assert data["trace"].pop("events") == alone["trace"].pop("events") + 2
    assert alone.pop("survived_out_of_memory") == []
    for judged in (data["simulated"], *data["what_if"]):  # each runs out where the run did: 2 events further on
        if "runs_out_at" in judged:
            assert judged["runs_out_at"]["event"] == 965
            judged["runs_out_at"]["event"] -= 2
    assert data == alone
    assert main(["allocator", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[4].startswith(
        "out of memory at event 965 (the last of 3, the one the run ended on: a request of 9.20 GiB)"
    )
    assert lines[5] == (
        "survived before it: 2 out-of-memory error(s) torch caught and the run went on from (at events 500, 901;"
        " requests of 40.00 GiB; cuDNN does, falling back to a convolution algorithm with less workspace): the run"
        " did not need that memory, and they are not replayed"
    )


@pytest.mark.parametrize("name", ["gpt2-b8", "gpt2-b150-expandable"])
def test_text_and_json_give_the_runs_settings_as_the_same_string(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(SNAPSHOTS[name])
    assert main(["allocator", "--json", path]) == 0
    settings = json.loads(capsys.readouterr().out)["simulated"]["settings"]
    assert main(["allocator", path]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    # The string PYTORCH_ALLOC_CONF held, quoted; "" said to be torch's defaults.
    expected = {"gpt2-b8": ("", " (torch's defaults)"), "gpt2-b150-expandable": ("expandable_segments:True", "")}[name]
    assert (settings, line) == (expected[0], f'allocator settings: "{expected[0]}"{expected[1]}')


def bad_files(directory: Path) -> list[tuple[Path, str]]:
    """Files that are not snapshots with a trace, and the message each gets."""
    cases = {
        "text.pickle": (b"not a pickle at all", "not a memory snapshot (not a pickle torch wrote"),
        "list.pickle": (pickle.dumps([1, 2, 3]), "not a memory snapshot (no 'segments' list)"),
        "class.pickle": (pickle.dumps(OrderedDict(a=1)), "not a memory snapshot (it names collections.OrderedDict)"),
        "empty.pickle": (pickle.dumps({"segments": [], "device_traces": []}), "no allocation trace in this snapshot"),
        "events.pickle": (
            pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}]]}),
            "not a memory snapshot (an event or segment lacks 'addr')",
        ),
    }
    found = []
    for name, (content, message) in cases.items():
        (directory / name).write_bytes(content)
        found.append((directory / name, message))
    return [*found, (directory / "missing.pickle", "no such file or directory"), (directory, "Is a directory")]


def test_a_file_that_is_not_a_snapshot_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, message in bad_files(tmp_path):
        assert main(["allocator", str(path)]) == 2, path
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith(f"lightning-vram: error: {path}: ") and message in captured.err, captured.err
        assert captured.err.count("\n") == 1


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    (path, _), *_ = bad_files(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "lightning_vram.cli", "allocator", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("name", "last_line"),
    [
        (  # the same batch with expandable_segments:True trained both its steps on that H100 (h100-gpt2-b91-expandable)
            "h100-gpt2-b91",
            "would have served the failed request in the same 78.45 GiB (simulated; the trace ends there):"
            " expandable_segments:True, max_split_size_mb:64, max_split_size_mb:128, max_split_size_mb:256,"
            " max_split_size_mb:512; for example PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py",
        ),
        (  # and batch 96 ran out of memory with expandable segments too (h100-gpt2-b96-expandable)
            "h100-gpt2-b96",
            "no setting tried serves the failed request in the same 78.45 GiB: the step itself must hold less"
            " (a smaller batch, 16-bit precision, activation checkpointing)",
        ),
    ],
)
def test_an_out_of_memory_trace_ends_with_whether_a_setting_would_have_saved_it(
    name: str, last_line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = not last_line.startswith("no setting tried serves")
    assert main(["allocator", str(SNAPSHOTS[name])]) == (0 if saved else 1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == last_line
    # The peaks listed are the model's with no limit (one above 78.45 GiB still fits: the cache released), and the
    # heading says so.
    assert lines[5] == (
        "what the allocator would have held with (serving the failed request too; the peaks with no limit, fits or"
        " out of memory within the 78.45 GiB the run had, its cache released and retried as torch does):"
    )


@pytest.mark.parametrize(("name", "released"), [("h100-resnet50-b952", 65), ("gpt2-b150", 0)])
def test_a_run_that_met_its_devices_memory_is_said_to_have(
    name: str, released: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # ResNet-50 at batch 952 trained on the H100 at its capacity: torch gave back cached segments to retry, and the
    # command's replay, with no limit, is 21% above its recorded peak. The H200's batch 150 ran clear of its memory.
    assert main(["allocator", "--json", str(SNAPSHOTS[name])]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["segments_released_mid_run"] == released
    assert main(["allocator", str(SNAPSHOTS[name])]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("the run met its device's memory")]
    assert said == (
        [
            "the run met its device's memory: the allocator gave back 65 cached segment(s) before its last allocation"
            " (torch does when a cudaMalloc fails, then retries; or the code called torch.cuda.empty_cache()); these"
            " replays have no limit, so their reserved peaks can be above what that device let it hold"
        ]
        if released
        else []
    )


def _judged(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    status = main(["allocator", "--json", *arguments])
    data = dict(json.loads(capsys.readouterr().out))
    assert status == served_status(data)
    return data


def test_capacity_judges_the_run_and_each_setting_on_another_card(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(SNAPSHOTS["gpt2-b150"])
    expandable_peak = recorded_peak("gpt2-b150-expandable")
    data = _judged([path, "--capacity", str(expandable_peak)], capsys)
    assert data["capacity"] == {"bytes": expandable_peak, "given": True}
    # On a card holding what the expandable run reserved, the default allocator runs out of memory at a request of
    # 15,438,950,400 B (even after releasing its cache), and expandable segments serve the whole trace.
    runs_out = data["simulated"]["runs_out_at"]
    assert data["simulated"]["fits"] is False and runs_out["request_bytes"] == 15_438_950_400
    event = load("gpt2-b150")[0]["device_traces"][0][runs_out["event"]]
    assert (event["action"], event["size"]) == ("alloc", runs_out["request_bytes"])  # the request it ran out at
    assert data["what_if"][0]["setting"] == "expandable_segments:True" and data["what_if"][0]["fits"] is True
    assert "runs_out_at" not in data["what_if"][0]
    assert main(["allocator", path, "--capacity", str(expandable_peak)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == (
        f"at the {format_bytes(expandable_peak)} given (--capacity), with these settings (simulated): out of memory"
        f" at event {runs_out['event']} (a request of {format_bytes(15_438_950_400)},"
        f" {format_bytes(runs_out['allocated_bytes'])} allocated)"
    )
    assert lines[-1].startswith(
        f"would have served the whole trace in the {format_bytes(expandable_peak)} given (--capacity) (simulated over"
        " the trace): expandable_segments:True"
    )


def test_capacity_takes_units_and_judges_a_run_that_ran_out_on_a_larger_card(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = str(SNAPSHOTS["h100-gpt2-b96"])
    # 10**11 B as bytes and as 100GB; 93.13 GiB serve the 9.20 GiB request the H100's 78.45 GiB could not.
    data = _judged([path, "--capacity", "100GB"], capsys)
    assert data == _judged([path, "--capacity", str(10**11)], capsys)
    assert data["capacity"] == {"bytes": 10**11, "given": True}
    assert data["simulated"]["fits"] is True and all(entry["fits"] for entry in data["what_if"])
    assert data["out_of_memory"]["capacity_bytes"] == capacity("h100-gpt2-b96")  # the run's own, still said
    # Without --capacity, the judgement is at the run's own capacity.
    assert _judged([path], capsys)["capacity"] == {"bytes": capacity("h100-gpt2-b96"), "given": False}
    assert _judged([path, "--capacity", "1.5 GiB"], capsys)["capacity"]["bytes"] == 1536 * MIB
    assert main(["allocator", path, "--capacity", "100GB"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "with these settings, would have served the failed request in the 93.13 GiB given (--capacity)"
        " (simulated; the trace ends there)"
    )


@pytest.mark.parametrize("value", ["40G", "abc", "0", "-5", "1000", "2PiB", ""])
def test_a_bad_capacity_is_one_line_and_status_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["allocator", str(SNAPSHOTS["gpt2-b8"]), f"--capacity={value}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "lightning-vram: error: --capacity must be the device memory to judge at: bytes from 1 MiB to 1 PiB, as an"
        f" integer or a number with a unit (40GiB, 80GB), got {value!r}\n"
    )


def test_capacity_is_in_the_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["allocator", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--capacity SIZE judge at this much device memory" in out and "40GiB, 80GB" in out
