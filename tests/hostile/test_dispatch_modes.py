"""H5: a user's dispatch mode spanning the step (an op counter entered in ``on_train_batch_start`` and left in
``on_train_batch_end``, by the LightningModule or by a Callback before or after the monitor).

Found attacking 0.11.0: with the mode entered after the monitor's live count, training hung forever on the next
sampled step (a loop in ``leave_abandoned`` that could not end); listed before the monitor, the user's op counter saw
the monitor's own ops. Each case trains with and without the monitor, every step sampled, in a child process with a
timeout: the same losses, weights, RNG, and the same ops and flops seen by the user's counters, step by step.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness import PATHS
from preloaded_python import run_script

SCRIPT = Path(__file__).with_name("dispatch_mode_run.py")
WHERE = ("module", "before", "after")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, str]]:
    """Each path's child process, run on first use: ``{path: {where: "identical" or the assertion that failed}}``."""
    return {}


def outcome(
    outcomes: dict[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory, path: str, where: str
) -> str:
    """``where``'s outcome on ``path``; the first case of a path runs its child (one that hangs or fails fails all)."""
    if path not in outcomes:
        root = tmp_path_factory.mktemp(f"dispatch-{path}")
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
        try:
            done = run_script(SCRIPT, path, str(root), *WHERE, timeout=240 * len(WHERE), env=environment)
        except subprocess.TimeoutExpired:
            outcomes[path] = dict.fromkeys(WHERE, "training hung")
        else:
            failed = f"the child failed: {done.stderr[-3000:]}"
            read = json.loads((root / "outcomes.json").read_text()) if done.returncode == 0 else {}
            outcomes[path] = {case: read.get(case, failed) for case in WHERE}
    return outcomes[path][where]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("path", PATHS)
def test_a_dispatch_mode_spanning_the_step_trains_and_counts_as_without_the_monitor(
    outcomes: dict[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory, path: str, where: str
) -> None:
    assert outcome(outcomes, tmp_path_factory, path, where) == "identical"
