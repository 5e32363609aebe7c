"""The test suite's own set-up: helper scripts beside the tests are neither collected nor imported as test modules;
the tests' monitors replay only where a test asks (tests/conftest.py).

``--doctest-modules`` imports every module it collects; the helper scripts import deepspeed and start processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from collected import COLLECTED, Collection
from models import REPLAYS_ON, TEST_REPLAY_BUDGET_SECONDS
from preloaded_python import run_script

from lightning_vram import VramMonitor, VramSession
from lightning_vram.config import MonitorConfig

TESTS = Path(__file__).parent
HELPER_SCRIPTS = ("ddp_train", "shard_accounting", "sharded_train", "zero_accounting")
COLLECT_AND_REPORT = """
import json, pytest
from collected import COLLECTED

class Report:
    def pytest_collection_finish(self, session):
        found = session.config.stash[COLLECTED]
        record = [sorted(found.modules), found.files, found.items, sorted(found.paths)]
        print("IMPORTED", json.dumps(record), flush=True)

pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", {tests!r}], plugins=[Report()])
"""


def collection(config: pytest.Config) -> Collection:
    """What this session's collection saw, where it collected every test file; else a collection of the whole suite
    in a process of its own (``tests/collected.py``)."""
    every = {str(path) for path in TESTS.rglob("test_*.py")}
    found = config.stash.get(COLLECTED, None)
    if found is not None and every <= found.paths:
        return found
    code = COLLECT_AND_REPORT.format(tests=str(TESTS))
    completed = subprocess.run(  # only a hang takes 900 s, even on a loaded 2-core machine
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False, cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    line = next(line for line in completed.stdout.splitlines() if line.startswith("IMPORTED "))
    modules, files, items, paths = json.loads(line.removeprefix("IMPORTED "))
    return Collection(frozenset(modules), tuple((name, start) for name, start in files), items, frozenset(paths))


def test_helper_scripts_are_not_imported_while_collecting(request: pytest.FixtureRequest) -> None:
    found = collection(request.config)
    assert all((TESTS / f"{script}.py").exists() for script in HELPER_SCRIPTS)
    helpers = sorted(name for name in found.modules if name.rsplit(".", 1)[-1] in HELPER_SCRIPTS)
    assert ("deepspeed" in found.modules, helpers) == (False, [])
    assert found.items > 100  # the tests themselves were collected
    # The files that start processes (any of their tests) come first, the long ones `make test` hands its workers
    # before the short ones.
    starts = [start for _, start in found.files]
    assert starts == sorted(starts, reverse=True) and starts.count(True) >= 2
    assert {"test_distributed.py", "test_distributed_replay.py"} <= {name for name, start in found.files if start}


def test_a_script_run_by_the_tests_starts_with_torch_lightning_and_deepspeed_imported(tmp_path: Path) -> None:
    # tests/preloaded_python.py's server imported them once (tests/preloaded_imports.py): a script's run does not.
    # Python 3.11's forkserver skipped that preload without a word when started from the repository's root.
    script = tmp_path / "what_is_imported.py"
    names = ["torch", "lightning", "deepspeed", "transformers.models.gpt2.modeling_gpt2"]
    script.write_text(f"import sys\nprint([name in sys.modules for name in {names!r}])\n")
    result = run_script(script, timeout=900)  # only a hang takes 900 s
    assert (result.returncode, result.stdout.strip()) == (0, str([True] * len(names))), result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ replays in tests


@pytest.fixture(scope="module")
def shared_monitor() -> VramMonitor:
    """A monitor built by a fixture wider than a test: before any test's own set-up."""
    return VramMonitor()


def test_a_test_s_monitors_replay_nothing_unless_it_names_a_replay_option(shared_monitor: VramMonitor) -> None:
    assert (VramMonitor().config.replay_budget_seconds, VramSession().config.preflight) == (0.0, False)
    assert VramMonitor(preflight=True).config == MonitorConfig(**REPLAYS_ON)  # a test that names one gets its way
    assert VramMonitor(**REPLAYS_ON).config.replay_budget_seconds == TEST_REPLAY_BUDGET_SECONDS
    assert shared_monitor.config == MonitorConfig(**REPLAYS_ON)  # fixtures wider than a test: the tests' defaults


@pytest.mark.replay
def test_a_test_marked_replay_gets_the_library_s_defaults() -> None:
    assert VramMonitor().config == VramSession().config == MonitorConfig(**REPLAYS_ON)
    assert (MonitorConfig().replay_budget_seconds, MonitorConfig().preflight) == (TEST_REPLAY_BUDGET_SECONDS, True)
    # The library's own default, which users' runs and the processes the tests start keep.
    (default,) = [field.default for field in dataclasses.fields(MonitorConfig) if field.name == "replay_budget_seconds"]
    assert default == 30.0
