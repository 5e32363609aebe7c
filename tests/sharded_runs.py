"""Starting tests/zero_advice_train.py's gloo run and reading each rank's files back (shared by its tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from preloaded_python import run_script
from test_distributed import HANG, free_port

WORLD = 2


def run_zero(out: Path, stage: int, *extra: str, world: int = WORLD) -> list[dict[str, Any]]:
    """Each rank's ``rank<r>.json`` (``{}`` with ``no-monitor``) from a ZeRO-``stage`` run of ``world`` ranks."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = Path(__file__).parent / "zero_advice_train.py"
    arguments = (str(world), str(free_port()), str(out), str(stage), *extra)
    result = run_script(script, *arguments, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    files = [out / f"rank{rank}.json" for rank in range(world)]
    return [json.loads(file.read_text()) if file.exists() else {} for file in files]


def training(out: Path, rank: int) -> dict[str, Any]:
    """What rank ``rank`` trained: losses, parameters, optimizer state, ZeRO's master partition, RNG state."""
    return json.loads((out / f"training{rank}.json").read_text())
