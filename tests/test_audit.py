"""The audit hook that refuses a replay's file writes, processes and connections: only on the replaying thread."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest

from lightning_vram.prediction.containment.audit import (
    OutsideEffectError,
    OutsideEffectsRepeated,
    audit_refusal,
    refusing_outside_effects,
)


@pytest.fixture(autouse=True)
def hook_added() -> None:
    assert audit_refusal() is None, "the hook does not run in this process"


def test_a_write_is_refused_before_the_file_is_made_and_named_in_the_reason(tmp_path: Path) -> None:
    target = tmp_path / "steps.txt"
    with refusing_outside_effects() as effects, pytest.raises(OutsideEffectError):
        target.open("a")
    assert not target.exists()
    assert effects.reason is not None
    assert effects.reason.startswith(f"the step writes files (open({str(target)!r}, 'a')): a replay would write them")


def test_reads_pass_and_writes_pass_again_once_the_replay_ends(tmp_path: Path) -> None:
    source = tmp_path / "scale.txt"
    source.write_text("0.5")
    with refusing_outside_effects() as effects:
        assert source.read_text() == "0.5"
        os.close(os.open(source, os.O_RDONLY))
    assert effects.reason is None
    source.write_text("1.0")
    assert source.read_text() == "1.0"


def test_a_caught_refusal_still_refuses_the_replay(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.write_text("")
    with refusing_outside_effects() as effects, contextlib.suppress(OSError):  # the user's code catches it
        os.remove(scratch)
    assert scratch.exists()
    assert effects.reason is not None and f"removes files (os.remove({str(scratch)!r}" in effects.reason


@pytest.mark.parametrize(
    "call",
    [
        lambda path: os.close(os.open(path / "x", os.O_WRONLY | os.O_CREAT)),
        lambda path: os.mkdir(path / "x"),
        lambda path: os.rename(path / "kept", path / "x"),
        lambda path: os.truncate(path / "kept", 0),
        lambda path: (path / "x").symlink_to(path / "kept"),
        lambda path: subprocess.run([sys.executable, "-c", f"open({str(path / 'x')!r}, 'w')"], check=True),
    ],
    ids=["os.open", "os.mkdir", "os.rename", "os.truncate", "os.symlink", "subprocess"],
)
def test_each_kind_of_change_is_refused_before_it_happens(tmp_path: Path, call: object) -> None:
    (tmp_path / "kept").write_text("kept")
    with refusing_outside_effects() as effects, pytest.raises(OutsideEffectError):
        call(tmp_path)  # type: ignore[operator]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept"]
    assert (tmp_path / "kept").read_text() == "kept"
    assert effects.reason is not None


def append_retrying(path: Path, tries: list[int]) -> None:
    """The user's retry loop, which catches every ``Exception`` (a file locked for a while)."""
    for attempt in range(1000):
        tries.append(attempt)
        try:
            path.open("a")
            return
        except Exception:  # noqa: BLE001 -- the user's own
            continue


def test_a_refused_call_tried_again_stops_the_replay_past_the_user_s_except(tmp_path: Path) -> None:
    target = tmp_path / "steps.txt"
    tries: list[int] = []
    with refusing_outside_effects() as effects, pytest.raises(OutsideEffectsRepeated):
        append_retrying(target, tries)
    assert tries == [0, 1]
    assert not target.exists()
    assert effects.reason is not None and "steps.txt', 'a')" in effects.reason


def test_another_thread_writes_while_this_one_replays(tmp_path: Path) -> None:
    def write() -> None:
        (tmp_path / "other.txt").write_text("written")

    with refusing_outside_effects() as effects:
        other = threading.Thread(target=write)
        other.start()
        other.join()
    assert (tmp_path / "other.txt").read_text() == "written"
    assert effects.reason is None


def test_a_module_imported_for_the_first_time_writes_its_bytecode_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "first_import_in_a_replay.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    with refusing_outside_effects() as effects:
        module = importlib.import_module("first_import_in_a_replay")
    monkeypatch.delitem(sys.modules, "first_import_in_a_replay")
    assert module.VALUE == 3
    assert effects.reason is None
    assert [path.suffix for path in (tmp_path / "__pycache__").iterdir()] == [".pyc"]


class Owner:
    """An object of an earlier run whose finalizer removes its own file (as a monitor's hand-back file is)."""


def test_finalizers_the_garbage_collector_calls_during_a_replay_are_not_the_replay_s(tmp_path: Path) -> None:
    leftover = tmp_path / "leftover.json"
    leftover.write_text("{}")
    owner = Owner()
    owner.cycle = owner  # type: ignore[attr-defined]  # only the collector frees it
    weakref.finalize(owner, leftover.unlink)
    del owner
    with refusing_outside_effects() as effects:
        gc.collect()
        assert not leftover.exists()
        with pytest.raises(OutsideEffectError):
            (tmp_path / "after.txt").write_text("")
    assert effects.reason is not None and "after.txt" in effects.reason
