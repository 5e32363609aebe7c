"""The lightning-vram command starts without torch, Lightning, matplotlib or numpy; the package's exports stay lazy.

Each check runs a fresh interpreter and reads its ``sys.modules``: a behaviour, never a time
(``benchmarks/cli_startup.py`` prints the times).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from advice_summaries import healthy_summary

import lightning_vram
from lightning_vram.records import Report

HEAVY = ("torch", "lightning", "pytorch_lightning", "matplotlib", "numpy")
"""What the command must not import to answer ``--help``, ``--version`` or ``show``."""

RUN_AND_REPORT = f"""
import contextlib, io, json, sys
from lightning_vram.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exit:
        status = exit.code
heavy = sorted(name for name in {HEAVY!r} if name in sys.modules)
print(json.dumps({{"status": status, "out": out.getvalue(), "heavy": heavy}}))
"""


def run_command(*arguments: str) -> tuple[int, str, list[str]]:
    """Run the command in a fresh interpreter: its status, its output, and which heavy modules it imported."""
    result = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, *arguments], capture_output=True, text=True, check=True, timeout=300
    )
    answer = json.loads(result.stdout)
    return answer["status"], answer["out"], answer["heavy"]


@pytest.mark.parametrize(
    "arguments",
    [["--help"], ["--version"], ["show", "--help"], ["html", "--help"], ["diff", "--help"], ["allocator", "--help"]],
    ids=["help", "version", "show-help", "html-help", "diff-help", "allocator-help"],
)
def test_help_and_version_import_nothing_heavy(arguments: list[str]) -> None:
    status, out, heavy = run_command(*arguments)
    assert status == 0 and out
    assert heavy == []


def test_version_prints_the_package_version() -> None:
    status, out, _ = run_command("--version")
    assert status == 0
    assert out == f"lightning-vram {lightning_vram.__version__}\n"


def test_diff_help_explains_each_argument() -> None:
    _, out, _ = run_command("diff", "--help")
    assert "run A's vram_report.json, or a log dir holding one" in out
    assert "run B's vram_report.json, or a log dir holding one" in out


def test_show_and_diff_read_a_report_without_torch(tmp_path: Path) -> None:
    path = tmp_path / "vram_report.json"
    report = Report(summary=healthy_summary(), precision="32-true", modules=(), advice=(), fit=(), ranks=())
    path.write_text(json.dumps(report.to_dict()))
    for arguments in (["show", str(path)], ["show", "--json", str(path)], ["diff", str(path), str(path)]):
        status, out, heavy = run_command(*arguments)
        assert status == 0 and out
        assert heavy == [], arguments


def test_allocator_replays_a_snapshot_without_torch() -> None:
    snapshot = Path(__file__).parent / "data" / "gpu-traces" / "gpt2-b8.pickle"
    for arguments in (["allocator", str(snapshot)], ["allocator", "--json", str(snapshot)]):
        status, out, heavy = run_command(*arguments)
        assert status == 0 and ("reserved_peak_bytes" in out or "reserved peak: recorded" in out)
        assert heavy == [], arguments


IMPORTS_AND_REPORTS = f"""
import sys
import lightning_vram
version = lightning_vram.__version__
print(version, sorted(name for name in {HEAVY!r} if name in sys.modules))
import lightning_vram.predict
from lightning_vram import predict, VramMonitor, Report, VramSession, VramMonitorWarning
exported = set(lightning_vram.__all__) <= set(dir(lightning_vram))
print(callable(predict) and predict.__module__, VramMonitor.__name__, exported)
import lightning_vram.plan
from lightning_vram.plan import DEFAULT_WORLD_SIZES
from lightning_vram import plan
print(callable(plan) and plan.__module__, lightning_vram.plan is plan, DEFAULT_WORLD_SIZES)
"""


def test_the_package_imports_its_exports_on_first_use() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_AND_REPORTS], capture_output=True, text=True, check=True, timeout=300
    )
    first, second, third = result.stdout.splitlines()
    assert first == f"{lightning_vram.__version__} []"
    # `import lightning_vram.predict` names the submodule on the package: the export stays the function.
    assert second == "lightning_vram.predict VramMonitor True"
    assert third == "lightning_vram.plan True (1, 2, 4, 8)"  # plan() likewise, its module's names still importable


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        _ = lightning_vram.missing  # type: ignore[attr-defined]


QUICKSTART = f"{Path(__file__).resolve().parents[1] / 'examples' / 'quickstart.py'}:SmallCNN"


@pytest.mark.parametrize(
    ("arguments", "starts"),
    [
        (["--batch", "int64[8,128"], "--batch must be dtype[sizes] items"),
        (["--batch", "complex[4]"], "--batch must name a dtype of float32,"),
        (["--batch", "x=float32[4] int64[4]"], "--batch must name every tensor"),
        (["--batch", "int64[8,0]"], "--batch must give sizes as integers >= 1"),
        (
            ["--batch", "float32[-1,3,64,64]"],
            "--batch must give sizes as integers >= 1; got '-1' in 'float32[-1,3,64,64]'\n",
        ),
        (["--gpu", "1024"], "--gpu must give a GPU's memory as bytes from 1 MiB to 1 PiB, got 1024"),
        (["--gpus", "0"], "--gpus must hold ints from 1 to 1024, got 0"),
        (["--nodes", "0"], "--nodes must be an int from 1 to 1024, got 0"),
        (["--global-batch", "0"], "--global-batch must be an int from 1 to 1000000000, got 0"),
        (
            ["--global-batch", "10", "--gpus", "4"],
            "--global-batch must be a multiple of a GPU count planned for (4), got 10\n",
        ),
        (["--budget", "0"], "--budget must be a number of seconds > 0 and under a day, got 0.0"),
    ],
)
def test_plan_refuses_bad_syntax_before_importing_torch_or_building_the_module(
    arguments: list[str], starts: str
) -> None:
    # A new user's malformed --batch was refused only after ~18 s of imports and the module's construction.
    result = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, "plan", QUICKSTART, *arguments],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    answer = json.loads(result.stdout)
    assert answer["status"] == 2 and answer["out"] == ""
    assert result.stderr.startswith(f"lightning-vram: error: {starts}") and result.stderr.count("\n") == 1
    assert answer["heavy"] == []
