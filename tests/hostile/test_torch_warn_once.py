"""torch's warn-once warnings (``TORCH_WARN_ONCE``) the step reaches: the user sees them as without the monitor.

Such a warning is shown once a process, whoever reaches it first. The CUDA path's preflight replays the step before
step 0 runs, silenced: it used up the warning, and the user never saw it (0 against 1 without the monitor).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import PATHS
from preloaded_python import run_script

SCRIPT = Path(__file__).with_name("warn_once_run.py")


def shown(root: Path, *path: str) -> int:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    done = run_script(SCRIPT, str(root), *path, timeout=240, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", PATHS)
def test_a_warn_once_warning_of_torch_is_shown_as_without_the_monitor(tmp_path: Path, path: str) -> None:
    assert shown(tmp_path / "bare") == 1
    assert shown(tmp_path / "watched", path) == 1
