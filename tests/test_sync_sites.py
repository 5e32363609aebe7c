"""scripts/sync_sites.py's CPU dry run: the lines a GPU session pastes say how the hooks were checked."""

from __future__ import annotations

import os
from pathlib import Path

from preloaded_python import run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sync_sites.py"


def test_the_dry_run_names_its_settings_and_says_it_checked_nothing() -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    run = run_script(SCRIPT, "--cpu-dry-run", "--replays-off", "--steps", "2", cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # The settings the test's failure depends on (sync mode, replays) are in the first line, beside the versions.
    assert lines[0].endswith(", cpu (dry run), SGD, sync mode none (no CUDA), replays off, 2 steps"), lines[0]
    assert lines[-1] == "0 synchronising sites in VramMonitor's hooks (a CPU dry run: nothing was checked)"
