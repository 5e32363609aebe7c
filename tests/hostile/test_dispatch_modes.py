"""H5: a user's dispatch mode spanning the step (an op counter entered in ``on_train_batch_start`` and left in
``on_train_batch_end``, by the LightningModule or by a Callback before or after the monitor).

Found attacking 0.11.0: with the mode entered after the monitor's live count, training hung forever on the next
sampled step (a loop in ``leave_abandoned`` that could not end); listed before the monitor, the user's op counter saw
the monitor's own ops. Each case trains with and without the monitor, every step sampled, in a child process with a
timeout: the same losses, weights, RNG, and the same ops and flops seen by the user's counters, step by step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import PATHS

SCRIPT = Path(__file__).with_name("dispatch_mode_run.py")


@pytest.mark.parametrize("where", ["module", "before", "after"])
@pytest.mark.parametrize("path", PATHS)
def test_a_dispatch_mode_spanning_the_step_trains_and_counts_as_without_the_monitor(
    tmp_path: Path, path: str, where: str
) -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), where, path, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=240,
            env=environment,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("training hung")
    assert done.returncode == 0, done.stderr[-3000:]
