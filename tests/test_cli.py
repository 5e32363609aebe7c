"""The lightning-vram command on real reports and on bad input."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Classifier, dataset, loader, mlp, trainer

import lightning_vram
from lightning_vram import Report, VramMonitor
from lightning_vram.cli import main
from lightning_vram.codec import report_from_dict
from lightning_vram.render.text import advice_summary, headline, wrapped
from lightning_vram.units import format_bytes


def run(root: Path, inplace: bool, batch_size: int) -> tuple[Report, Path]:
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(
        Classifier(mlp(256, 8, inplace=inplace)), loader(dataset(256, 2048), batch_size)
    )
    assert monitor.report is not None
    return monitor.report, root


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Report, Path], tuple[Report, Path]]:
    before = run(tmp_path_factory.mktemp("before"), inplace=False, batch_size=512)
    after = run(tmp_path_factory.mktemp("after"), inplace=True, batch_size=256)
    return before, after


def test_show_a_log_dir_or_a_file(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    (report, root), _ = two_runs
    assert main(["show", str(root)]) == 0
    from_dir = capsys.readouterr().out
    assert from_dir.startswith("VRAM report:") and f"Live peak {format_bytes(report.peak.peak_bytes)}" in from_dir  # type: ignore[union-attr]
    assert main(["show", str(root / "vram_report.json")]) == 0
    assert capsys.readouterr().out == from_dir


def test_html_writes_the_page(two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path) -> None:
    (_, root), _ = two_runs
    output = tmp_path / "page.html"
    assert main(["html", str(root), "-o", str(output)]) == 0
    assert output.read_text() == (root / "vram_report.html").read_text()


def test_diff_shows_what_changed(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    (before, before_root), (after, after_root) = two_runs
    assert main(["diff", str(before_root), str(after_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert before.peak is not None and after.peak is not None
    assert before.peak.breakdown is not None and after.peak.breakdown is not None
    saved = before.peak.peak_bytes - after.peak.peak_bytes
    assert saved > 0
    assert lines[0] == (
        f"peak: {format_bytes(before.peak.peak_bytes)} -> {format_bytes(after.peak.peak_bytes)}:"
        f" -{format_bytes(saved)} (-{saved / before.peak.peak_bytes:.1%})"
    )
    activations = next(line for line in lines if line.strip().startswith("activations:"))
    assert (
        f"{format_bytes(before.peak.breakdown.activations)} -> {format_bytes(after.peak.breakdown.activations)}"
        in activations
    )
    assert "  parameters: " in "\n".join(lines) and "+0 B (+0.0%)" in "\n".join(lines)
    assert "advice removed: inplace-activations" in lines


def test_show_reads_a_report_written_before_the_replay(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0.7.0 wrote no simulation section, no advice basis or predicted peak, no fit basis.
    (report, root), _ = two_runs
    data = json.loads((root / "vram_report.json").read_text())
    data.pop("simulation", None)
    for entry in data["advice"]:
        del entry["saving_basis"], entry["predicted_peak_bytes"]
    old = tmp_path / "vram_report.json"
    old.write_text(json.dumps(data))
    assert main(["show", str(old)]) == 0
    out = capsys.readouterr().out
    lines, head = out.splitlines(), wrapped(f"  {headline(report)}", 80)
    assert lines[0].startswith("VRAM report:") and lines[1 : 1 + len(head)] == head
    first = wrapped(f"  {advice_summary(report_from_dict(data).advice[0])}", 80)
    assert lines[1 + len(head) : 1 + len(head) + len(first)] == first  # the advice right after the headline
    assert first[0].startswith("  advice: ")
    assert "(simulated)" not in out and "(modelled)" not in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file or directory"),
        ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1)"),
        ('{"steps": 3, "phases": {"forward": {"peak_bytes": 12', "the file ends early: truncated (52 bytes)"),
        ('{"steps": 3, "device": {"name": "NVIDIA H1', "the file ends early: truncated (42 bytes)"),
        ("  \n", "not JSON (the file is empty)"),
        (json.dumps({"schema": "someone_else/2"}), "not a lightning_vram report"),
        (json.dumps({"schema": "lightning_vram.report/1", "steps": 3}), "missing field 'device'"),
        (json.dumps([1, 2]), "not a lightning_vram report"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "vram_report.json"
    if content is not None:
        path.write_text(content)
    assert main(["show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("lightning-vram: error: ") and message in captured.err
    assert captured.err.count("\n") == 1


def test_a_dir_without_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(tmp_path), str(tmp_path)]) == 2
    assert "no vram_report.json in this directory or 4 levels below it" in capsys.readouterr().err


def test_the_installed_command(tmp_path: Path) -> None:
    (script,) = entry_points(group="console_scripts", name="lightning-vram")
    assert script.value == "lightning_vram.cli:main"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_vram.cli", "show", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("environment", ["inherited", "minimal"])
def test_output_to_a_reader_that_went_away_is_no_traceback(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], environment: str
) -> None:
    (_, root), _ = two_runs
    path = root / "vram_report.json"
    # Minimal: as cron or a bare container runs it (`env -i`): no PYTHONUNBUFFERED, so standard output into a pipe is
    # block-buffered and written only when flushed; the package from this checkout.
    package_root = str(Path(lightning_vram.__file__).parents[1])
    variables = None if environment == "inherited" else {"PATH": "/usr/bin:/bin", "PYTHONPATH": package_root}
    reader, writer = os.pipe()
    os.close(reader)  # `lightning-vram show ... | head -0`: every write meets a closed pipe
    try:
        result = subprocess.run(
            [sys.executable, "-m", "lightning_vram.cli", "show", str(path)],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=900,  # only a hang reaches it
            env=variables,
        )
    finally:
        os.close(writer)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert result.returncode == 0


# ---------------------------------------------------------------------------------------- hostile and broken reports

SENTINEL = "@@replace-me@@"


def with_raw_field(report: dict[str, Any], path: tuple[str | int, ...], raw: str) -> bytes:
    """The report's JSON with the field at ``path`` replaced by the raw JSON text ``raw``."""
    data = copy.deepcopy(report)
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = SENTINEL
    return json.dumps(data).replace(json.dumps(SENTINEL), raw).encode()


# (id, field, raw JSON put there, what the one line must say)
BAD_FIELDS = [
    ("infinity", ("timing", "step_seconds_median"), "Infinity", "Infinity is not a number JSON allows"),
    ("nan", ("timing", "data_wait_fraction"), "NaN", "NaN is not a number JSON allows"),
    ("integer-too-long", ("peak", "allocated_bytes"), "9" * 5000, "an integer of 5000 digits"),
    ("beyond-int64", ("peak", "allocated_bytes"), str(2**63), "peak.allocated_bytes must be at most 2**63 - 1"),
    ("float-overflow", ("timing", "step_seconds_median"), "1e999", "step_seconds_median must be a finite number"),
    ("deep-nesting", ("precision",), "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("bytes-as-string", ("peak", "allocated_bytes"), '"12"', "peak.allocated_bytes must be an integer, got str"),
    ("seconds-as-list", ("timing", "step_seconds_median"), "[1, 2]", "step_seconds_median must be a number, got list"),
    ("negative-bytes", ("phases", "forward", "breakdown", "parameters"), "-5", "parameters must be >= 0, got -5"),
    ("bool-as-count", ("steps",), "true", "report.steps must be an integer, got bool"),
    ("object-as-list", ("device",), "[]", "report.device must be an object, got list"),
    ("module-name-number", ("modules", 0, "name"), "1", "modules[0].name must be a string, got int"),
    ("module-bytes-float", ("modules", 0, "activation_bytes"), "1.5", "activation_bytes must be an integer, got float"),
    (
        "inner-list-wrong",
        ("recent_peaks",),
        '[{"step": "a", "peak_bytes": 1}]',
        "recent_peaks[0].step must be an integer",
    ),
    ("not-measured-null", ("not_measured", 0, "reason"), "null", "not_measured[0].reason must be a string, got null"),
    ("unknown-phase", ("peak", "phase"), '"sideways"', "peak.phase must be one of"),
    ("odd-key", ("evaluation",), '{"val\\nidation": {"peak_bytes": "x"}}', "peak_bytes must be an integer, got str"),
    ("huge-string", ("schema",), json.dumps("x" * 1_000_000), "not a lightning_vram report"),
    ("basis-unknown", ("advice", 0, "saving_basis"), '"guessed"', "advice[0].saving_basis must be one of"),
    ("simulation-list", ("simulation",), "[]", "report.simulation must be an object, got list"),
]


def command_for(name: str, bad: Path, good: Path, output: Path) -> list[str]:
    if name == "show":
        return ["show", str(bad)]
    if name == "html":
        return ["html", str(bad), "-o", str(output)]
    return ["diff", str(good), str(bad)]


def assert_one_line_error(captured: pytest.CaptureFixture[str], *fragments: str) -> str:
    out, err = captured.readouterr()
    assert out == ""
    assert err.startswith("lightning-vram: error: ") and err.endswith("\n") and err.count("\n") == 1, err[:500]
    assert "Traceback" not in err and len(err) <= 1100
    for fragment in fragments:
        assert fragment in err
    return err


@pytest.mark.parametrize("command", ["show", "html", "diff"])
@pytest.mark.parametrize(("field", "raw", "message"), [case[1:] for case in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_a_report_wrong_inside_is_one_line_and_status_2(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    field: tuple[str | int, ...],
    raw: str,
    message: str,
) -> None:
    (_, root), _ = two_runs
    good = root / "vram_report.json"
    report = json.loads(good.read_text())
    assert report["modules"] and report["not_measured"] and report["recent_peaks"] and report["advice"]  # edited
    bad = tmp_path / "vram_report.json"
    bad.write_bytes(with_raw_field(report, field, raw))
    output = tmp_path / "page.html"
    assert main(command_for(command, bad, good, output)) == 2
    assert_one_line_error(capsys, str(bad), message)
    assert not output.exists()


def sparse_file(path: Path, size: int) -> Path:
    with path.open("wb") as file:
        file.truncate(size)
    return path


def dangling_link(directory: Path) -> Path:
    directory.mkdir()
    (directory / "vram_report.json").symlink_to(directory / "missing")
    return directory


def link_loop(directory: Path) -> Path:
    directory.mkdir()
    (directory / "a").symlink_to(directory / "b")
    (directory / "b").symlink_to(directory / "a")
    return directory / "a"


def directory_linking_to_itself(directory: Path) -> Path:
    (directory / "deeper").mkdir(parents=True)
    (directory / "deeper" / "back").symlink_to(directory)
    return directory


BAD_FILES = {
    "not-utf8": (lambda d: write(d / "r.json", b'{"schema": "\xff\xfe"}'), "not UTF-8 text (byte 12)"),
    "empty": (lambda d: write(d / "r.json", b""), "not JSON"),
    "huge-file": (lambda d: sparse_file(d / "r.json", 200 * 1024**2), "200.0 MiB is too large for a report"),
    "device": (lambda d: Path(os.devnull), "not a regular file"),
    "dangling-link-in-dir": (lambda d: dangling_link(d / "run"), "no vram_report.json in this directory"),
    "symlink-loop": (lambda d: link_loop(d / "loop"), "Too many levels of symbolic links"),
    "dir-linking-to-itself": (
        lambda d: directory_linking_to_itself(d / "run"),
        "no vram_report.json in this directory",
    ),
}


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("command", ["show", "html", "diff"])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_path_that_is_not_a_report_is_one_line_and_status_2(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    case: str,
) -> None:
    (_, root), _ = two_runs
    make, message = BAD_FILES[case]
    bad = make(tmp_path)
    output = tmp_path / "page.html"
    assert main(command_for(command, bad, root, output)) == 2
    assert_one_line_error(capsys, message)
    assert not output.exists()


def show_into(path: Path, statuses: list[int]) -> None:
    statuses.append(main(["show", str(path)]))


def test_a_fifo_is_refused_without_waiting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "run" / "vram_report.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    for path in (fifo, fifo.parent):  # named, and found in a log dir
        statuses: list[int] = []
        worker = threading.Thread(target=show_into, args=(path, statuses), daemon=True)
        worker.start()
        worker.join(timeout=120)  # a refusal takes a moment; only a wait on the FIFO lasts this long
        if worker.is_alive():  # blocked opening the FIFO: a writer lets it go, so that the test ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(timeout=30)
            pytest.fail("lightning-vram waited on a FIFO")
        assert statuses == [2]
        assert_one_line_error(capsys, f"{fifo}: not a regular file")


def test_an_unwritable_output_is_one_line_and_status_2(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (_, root), _ = two_runs
    assert main(["html", str(root), "-o", str(tmp_path / "missing" / "page.html")]) == 2
    assert_one_line_error(capsys, "No such file or directory")
    assert main(["html", str(root), "-o", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "Is a directory")


def test_a_path_with_a_line_break_stays_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "two\nlines\x1b[2J.json")]) == 2
    err = assert_one_line_error(capsys, "two\\nlines\\x1b[2J.json: no such file or directory")
    assert "\x1b" not in err


def test_show_keeps_a_hostile_module_name_on_its_line(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (_, root), _ = two_runs
    report = json.loads((root / "vram_report.json").read_text())
    report["modules"][0]["name"] = "evil\\nadvice [fake]: run rm -rf\\x1b[2J"  # escaped already: stays as it is
    (tmp_path / "vram_report.json").write_text(json.dumps(report))
    assert main(["show", str(tmp_path)]) == 0
    plain = capsys.readouterr().out
    report["modules"][0]["name"] = "evil\nadvice [fake]: run rm -rf\x1b[2J"
    (tmp_path / "vram_report.json").write_text(json.dumps(report))
    assert main(["show", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and shown == plain  # escaped before the lines are cut: the same lines
    assert "evil\\nadvice [fake]:" in shown


def test_html_of_a_report_with_many_long_module_names(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (_, root), _ = two_runs
    report = json.loads((root / "vram_report.json").read_text())
    report["modules"] = [
        {"name": f"blocks.{index}." + "x" * 5000, "type": "$\\frac{a}{$", "activation_bytes": 1000 - index}
        for index in range(500)
    ]
    (tmp_path / "vram_report.json").write_text(json.dumps(report))
    output = tmp_path / "page.html"
    assert main(["html", str(tmp_path), "-o", str(output)]) == 0
    assert capsys.readouterr().err == ""  # no matplotlib warning either
    page = output.read_text()
    assert page.count("<tr><td><code>blocks.") == 500  # the table lists every module; the figure the largest 30


def test_a_log_dir_with_several_reports_says_which_one_it_read(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import shutil

    (before, first), (after, second) = two_runs
    assert before.peak is not None and after.peak is not None and before.peak.peak_bytes != after.peak.peak_bytes
    shutil.copy(first / "vram_report.json", tmp_path / "vram_report.json")
    (tmp_path / "later").mkdir()
    shutil.copy(second / "vram_report.json", tmp_path / "later" / "vram_report.json")
    os.utime(tmp_path / "vram_report.json", (1, 1))  # the older one
    # The directory's own report, though older: it is the one the directory stands for; nothing to say.
    assert main(["show", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and f"Live peak {format_bytes(before.peak.peak_bytes)}" in captured.out
    os.remove(tmp_path / "vram_report.json")
    (tmp_path / "other").mkdir()
    shutil.copy(first / "vram_report.json", tmp_path / "other" / "vram_report.json")
    os.utime(tmp_path / "other" / "vram_report.json", (1, 1))
    assert main(["show", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"lightning-vram: reading {tmp_path / 'later' / 'vram_report.json'} (the newest of 2 reports 1 level below"
        f" {tmp_path})"
    )
    assert f"Live peak {format_bytes(after.peak.peak_bytes)}" in captured.out


def test_diff_with_a_bad_argument_prints_one_line_not_the_other_s_notice(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A new user's trial: `diff runs/base nothere` printed "reading ..., the newest of 4 reports" before its error.
    import shutil

    (_, first), (_, second) = two_runs
    for name, source in (("a", first), ("b", second)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        shutil.copy(source / "vram_report.json", tmp_path / "runs" / name / "vram_report.json")
    missing = tmp_path / "nothere"
    assert main(["diff", str(tmp_path / "runs"), str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"lightning-vram: error: {missing}: no such file or directory"]
    assert main(["diff", str(tmp_path / "runs"), str(tmp_path / "runs" / "a")]) == 0
    assert "the newest of 2 reports" in capsys.readouterr().err  # said once both are read


def without_phases(report: dict[str, Any], where: str) -> dict[str, Any]:
    """The report with the ``phases`` at ``where`` emptied: the run's, the replayed baseline's, each change's."""
    data = copy.deepcopy(report)
    if where in ("run", "all"):
        data["phases"] = {}
    if where in ("baseline", "all"):
        data["simulation"]["phases"] = {}
    if where in ("changes", "all"):
        for variant in data["simulation"]["variants"]:
            variant["phases"] = {}
    return data


@pytest.mark.parametrize("command", ["show", "show --json", "html", "diff A B", "diff B A"])
@pytest.mark.parametrize("where", ["run", "baseline", "changes", "all"])
def test_a_report_with_empty_phases_prints_what_there_is(
    two_runs: tuple[tuple[Report, Path], tuple[Report, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    where: str,
) -> None:
    (_, root), _ = two_runs
    good = root / "vram_report.json"
    report = json.loads(good.read_text())
    assert report["simulation"]["variants"] and report["simulation"]["timeline"] is not None  # there is a replay
    bad = tmp_path / "vram_report.json"
    bad.write_text(json.dumps(without_phases(report, where)))
    output = tmp_path / "page.html"
    arguments = {
        "show": ["show", str(bad)],
        "show --json": ["show", "--json", str(bad)],
        "html": ["html", str(bad), "-o", str(output)],
        "diff A B": ["diff", str(good), str(bad)],
        "diff B A": ["diff", str(bad), str(good)],
    }[command]
    assert main(arguments) == 0
    out, err = capsys.readouterr()
    assert err == ""
    if command == "show --json":
        written = json.loads(out)
        assert written == without_phases(written, where)  # the empty phases stay empty
        changes = written["simulation"]["variants"]
        assert [change["predicted_peak_bytes"] is None for change in changes] == [where in ("changes", "all")] * len(
            changes
        )
    elif command == "html":
        page = output.read_text()
        assert page.startswith("<!DOCTYPE html>") and page.count("replayed, no phase recorded") == (
            len(report["simulation"]["variants"]) if where in ("changes", "all") else 0
        )
    else:
        assert out.startswith("VRAM report:" if command == "show" else "peak: ")


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["show", ""], "path"),
        (["html", "", "-o", "page.html"], "path"),
        (["html", "vram_report.json", "-o", ""], "-o/--output"),
        (["diff", "", "vram_report.json"], "A"),
        (["allocator", ""], "SNAPSHOT"),
    ],
)
def test_an_empty_path_is_refused_not_read_as_the_current_directory(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    arguments: list[str],
    named: str,
) -> None:
    monkeypatch.chdir(tmp_path)  # a report here is what Path("") would read
    (tmp_path / "vram_report.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(arguments)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1].endswith(
        f"error: argument {named}: must be a file or directory, got an empty path ('')"
    )
    assert not (tmp_path / "page.html").exists()
