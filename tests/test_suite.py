"""The test suite's own set-up: helper scripts beside the tests are neither collected nor imported as test modules.

``--doctest-modules`` imports every module it collects; the helper scripts import deepspeed and start processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
HELPER_SCRIPTS = ("ddp_train", "shard_accounting", "sharded_train", "zero_accounting")
COLLECT_AND_REPORT = """
import json, sys, pytest

class Report:
    def pytest_collection_finish(self, session):
        helpers = sorted(name for name in sys.modules if name.rsplit(".", 1)[-1] in {helpers!r})
        found = {{"deepspeed": "deepspeed" in sys.modules, "helpers": helpers, "items": len(session.items)}}
        print("IMPORTED", json.dumps(found), flush=True)

pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", {tests!r}], plugins=[Report()])
"""


def test_helper_scripts_are_not_imported_while_collecting() -> None:
    code = COLLECT_AND_REPORT.format(helpers=set(HELPER_SCRIPTS), tests=str(TESTS))
    completed = subprocess.run(  # only a hang takes 900 s, even on a loaded 2-core machine
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False, cwd=TESTS.parent
    )
    line = next(line for line in completed.stdout.splitlines() if line.startswith("IMPORTED "))
    found = json.loads(line.removeprefix("IMPORTED "))
    assert all((TESTS / f"{script}.py").exists() for script in HELPER_SCRIPTS)
    assert (found["deepspeed"], found["helpers"]) == (False, [])
    assert found["items"] > 100  # the tests themselves were collected
