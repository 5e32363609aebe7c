"""scripts/gpu_check.py's CPU dry run: every row's code path on tiny models, so the GPU check does not rot unrun."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from preloaded_python import run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
MIB_CELL = re.compile(r"^\d+\.\d MiB$")
PERCENT_CELL = re.compile(r"^[+-]\d+\.\d\d%$")
RATIO_CELL = re.compile(r"^\d+\.\d{3}x \[\d+\.\d{3}-\d+\.\d{3}\]")
MICROSECONDS_CELL = re.compile(r"^-?\d+\.\d us/step$")
MODELS = ("tiny GPT-2", "tiny Llama", "tiny ResNet")


@functools.cache
def gpu_check() -> ModuleType:
    """The script as a module (for its table parser and remedy parser), loaded once."""
    spec = importlib.util.spec_from_file_location("scripts_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.replay
def test_the_cpu_dry_run_prints_every_row_with_figures_that_parse(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # One intra-op thread, as tests/conftest.py gives the tests' own process: the tiny models' steps spent more than
    # half of the script's CPU time in torch's spinning thread pool (49 CPU s with this machine's 2, 20 s with 1).
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    # Budgets far above what tiny models need (CI shares its CPUs): no row may be cut short; the timeout bounds it.
    # Started from the preloaded server (tests/preloaded_python.py), as `python scripts/gpu_check.py ...` would run.
    run = run_script(
        SCRIPT, "--cpu-dry-run", "--out", str(out), "--total-seconds", "1500", cwd=ROOT, env=env, timeout=560
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert text in run.stdout
    assert text.splitlines()[0].startswith("### gpu_check: CPU dry run (no GPU figure asserted)")
    assert "| section | row | predicted | measured | error | outcome |" in text
    rows = list(gpu_check().parse_table(text))
    assert not [row for row in rows if row["outcome"].startswith("ERROR") or "budget spent" in row["outcome"]], text

    tests = {row["row"]: row["outcome"] for row in rows if row["section"] == "GPU tests"}
    assert tests["test_gpu::test_replayed_allocator_peaks_match_the_real_ones_per_phase"] == (
        "skipped: needs a CUDA device"
    )
    assert "test_on_a_gpu::test_training_on_a_gpu_is_bit_identical_with_the_monitor" in tests
    assert all(outcome == "skipped: needs a CUDA device" for outcome in tests.values())

    overhead = {row["row"]: row for row in rows if row["section"] == "overhead"}
    ratios = {"bare", "EmptyCallback", "DeviceStatsMonitor", "VramMonitor"}
    hot_path = {"VramMonitor inside its hooks", "VramMonitor over the empty callback"}
    assert set(overhead) == ratios | hot_path
    assert all(RATIO_CELL.match(overhead[name]["outcome"]) for name in ratios), overhead
    assert overhead["bare"]["outcome"].startswith("1.000x")
    assert all(MICROSECONDS_CELL.match(overhead[name]["measured"]) for name in hot_path), overhead
    assert overhead["VramMonitor inside its hooks"]["outcome"].endswith("(target <= 50 us)")

    for model in MODELS:
        own = [row for row in rows if row["section"] == model]
        phases = [row for row in own if row["row"].endswith("live peak")]
        assert [row["row"] for row in phases] == ["forward live peak", "backward live peak", "optimizer live peak"]
        for row in phases:
            assert MIB_CELL.match(row["predicted"]) and MIB_CELL.match(row["measured"]), row
            assert PERCENT_CELL.match(row["error"]), row
        deviceless = [row for row in own if row["row"].endswith("predicted without the device")]
        assert [row["row"].split()[0] for row in deviceless] == ["forward", "backward", "optimizer"], own
        assert all(MIB_CELL.match(row["predicted"]) for row in deviceless), deviceless
        names = [row["row"] for row in own]
        assert "largest batch (dry run: the case's own batch)" in names and "largest batch +5%" in names
        batch = next(row for row in own if row["row"].startswith("largest batch ("))
        above = next(row for row in own if row["row"] == "largest batch +5%")
        assert (batch["measured"], batch["outcome"]) == ("fit", "ok: fits")
        assert int(above["predicted"]) == int(batch["predicted"]) + 1  # ceil(1.05 x 2) = 3
        # The dry run's batch is no prediction: that 3 fits too says nothing of one.
        assert (above["measured"], above["outcome"]) == ("fit", "fit (dry run: no prediction to judge)")
        preflight = next(row for row in own if row["row"].startswith("preflight at batch "))
        assert preflight["row"] == "preflight at batch 3"  # ceil(1.2 x 2)
        remedies = {row["row"]: row["outcome"] for row in own if row["row"].startswith("remedy: ")}
        assert remedies["remedy: gradients set to None before forward"] == "ok: fits"
        assert remedies["remedy: batch size 1"] == "ok: fits"


def test_preflight_remedies_are_applied_from_their_labels() -> None:
    remedy_options = gpu_check().remedy_options
    assert remedy_options("batch size 80") == {"batch_size": 80}
    assert remedy_options('precision="bf16-mixed"') == {"precision": "bf16-mixed"}
    assert remedy_options("gradients set to None before forward") == {"free_gradients": True}
    assert remedy_options("inplace activations in 3 module(s)") is None
