"""Report files: written through the logger's filesystem, local or remote; a failed write is not fatal nor truncated."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import fsspec
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from models import Classifier, dataset_for, loader, trainer
from sessions import FILES, plain_run
from torch import nn

from lightning_vram import Report, VramMonitor
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.render import files as files_module
from lightning_vram.render.html import render_html
from lightning_vram.render.json_text import indented_json
from lightning_vram.render.text import markdown


def files_warning(caught: list[warnings.WarningMessage]) -> str:
    """The one warning the guard gave for the report files."""
    messages = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
    relevant = [message for message in messages if "report files failed" in message]
    assert len(relevant) == 1, messages
    return relevant[0]


def not_measured_reason(report: Report | None, what: str) -> str:
    assert report is not None
    (reason,) = [item.reason for item in report.not_measured if item.what == what]
    return reason


# ------------------------------------------------------------------------------------------------ files that fail


@pytest.mark.parametrize("where", ["log dir is a file", "log dir below a file"])
def test_a_log_dir_in_the_way_warns_once_and_fit_ends(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("someone else's file\n")
    log_dir = blocker if where == "log dir is a file" else blocker / "run"
    monitor = VramMonitor(console_summary=False, attribution_start_step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(log_dir, [monitor], max_steps=2).fit(
            Classifier(nn.Sequential(nn.Linear(32, 10))), loader(dataset_for("linear"))
        )
    message = files_warning(caught)
    assert f"not written to {log_dir}: vram_report.json, vram_report.md, vram_report.html:" in message
    assert ("File exists" if where == "log dir is a file" else "Not a directory") in message
    assert monitor.report is not None and monitor.report.steps == 2  # training ran to its end
    assert monitor.report_path is None
    assert "not written to" in not_measured_reason(monitor.report, "report files")
    assert blocker.read_text() == "someone else's file\n"


def test_one_file_that_fails_leaves_the_others_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_page(report: Report, pngs: object) -> str:
        raise RuntimeError("the figure could not be drawn")

    monkeypatch.setattr(files_module, "_html", broken_page)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = plain_run(tmp_path)
    message = files_warning(caught)
    assert "vram_report.html: RuntimeError: the figure could not be drawn" in message
    assert "(vram_report.json, vram_report.md written)" in message
    assert sorted(os.listdir(tmp_path)) == ["vram_report.json", "vram_report.md"]
    assert session.report_path == tmp_path / "vram_report.json"
    assert session.report is not None
    assert "RuntimeError" in not_measured_reason(session.report, "report files")
    expected = session.report.to_dict()  # the JSON was written before the failure it cannot list
    expected["not_measured"] = [item for item in expected["not_measured"] if item["what"] != "report files"]
    assert json.loads((tmp_path / "vram_report.json").read_text()) == expected


class FileSystemProxy:
    """The ``os`` module as files.py sees it, with ``open`` or ``write`` failing the way a disk does."""

    def __init__(self, refuse_open: bool = False, write_budget: int | None = None) -> None:
        self.refuse_open = refuse_open
        self.write_budget = write_budget

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, mode: int = 0o777) -> int:
        if self.refuse_open:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return os.open(path, flags, mode)

    def write(self, descriptor: int, data: Any) -> int:
        """Writes until the budget is spent (part of a chunk when it runs out), then fails with ENOSPC."""
        if self.write_budget is None:
            return os.write(descriptor, data)
        if self.write_budget <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = os.write(descriptor, bytes(data[: self.write_budget]))
        self.write_budget -= written
        return written


def test_a_read_only_directory_warns_and_the_run_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod stops no write under root (as tests may run): the directory's refusal is simulated at os.open.
    monkeypatch.setattr(files_module, "os", FileSystemProxy(refuse_open=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = plain_run(tmp_path)
    message = files_warning(caught)
    for name in FILES:
        assert f"{name}: Permission denied" in message
    assert session.report is not None and session.report.steps == 3
    assert session.report_path is None
    assert os.listdir(tmp_path) == []


def test_a_disk_that_fills_up_part_way_leaves_no_truncated_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_run(tmp_path, steps=2)  # an earlier run's complete files
    before = {name: (tmp_path / name).read_bytes() for name in FILES}
    session = plain_run(None, steps=3)
    assert session.report is not None
    new_json = (indented_json(session.report.to_dict()) + "\n").encode()
    monkeypatch.setattr(files_module, "os", FileSystemProxy(write_budget=len(new_json) + 1000))
    with pytest.raises(files_module.FilesNotWritten) as failure:
        files_module.write_report_files(session.report, tmp_path)
    assert [name for name, _ in failure.value.failed] == ["vram_report.md", "vram_report.html"]
    assert "vram_report.md: No space left on device" in str(failure.value)
    assert failure.value.json_path == tmp_path / "vram_report.json"
    assert sorted(os.listdir(tmp_path)) == sorted(FILES)  # no temporary file left behind
    assert (tmp_path / "vram_report.json").read_bytes() == new_json
    for name in FILES[1:]:  # the earlier run's files, whole, not a truncated new one
        assert (tmp_path / name).read_bytes() == before[name]


FILE_SIZE_LIMIT = 16 * 1024
"""The kernel refuses writes beyond 16 KiB (RLIMIT_FSIZE) in the writing process: a real part-way failure, EFBIG."""

WRITE_UNDER_THE_LIMIT = """
import json, sys
from lightning_vram.codec import report_from_dict
from lightning_vram.render import files
report = report_from_dict(json.loads(open(sys.argv[1]).read()))
try:
    files.write_report_files(report, files.as_location(sys.argv[2]))
except files.FilesNotWritten as error:
    print(error)
"""


def test_a_file_size_limit_leaves_no_truncated_page(tmp_path: Path) -> None:
    resource = pytest.importorskip("resource")
    session = plain_run(None)
    assert session.report is not None
    report = without_timelines(session.report)  # a timeline of up to 1,000 points takes the JSON past the limit
    data = report.to_dict()
    assert len(render_html(report)) > FILE_SIZE_LIMIT > max(len(markdown(report)), len(json.dumps(data)))
    source, out = tmp_path / "report.json", tmp_path / "out"
    source.write_text(json.dumps(data))
    out.mkdir()

    def limited() -> None:  # in the child only: the test runner's own output stays unlimited
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    written = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_THE_LIMIT, str(source), str(out)],
        capture_output=True,
        text=True,
        timeout=900,  # only a hang takes this long
        preexec_fn=limited,
        check=False,
    )
    assert written.returncode == 0, written.stderr[-2000:]
    assert "vram_report.html: File too large" in written.stdout
    assert sorted(os.listdir(out)) == ["vram_report.json", "vram_report.md"]
    assert json.loads((out / "vram_report.json").read_text()) == data


def without_timelines(report: Report) -> Report:
    """``report`` without the replayed steps' timelines (memory during one step)."""
    simulation = report.simulation
    if simulation is None or simulation.baseline is None:
        return report
    variants = tuple(
        replace(variant, replayed=replace(variant.replayed, timeline=None)) if variant.replayed is not None else variant
        for variant in simulation.variants
    )
    baseline = replace(simulation.baseline, timeline=None)
    return replace(report, simulation=replace(simulation, baseline=baseline, variants=variants))


# ------------------------------------------------------------------------------------------------ remote log dirs


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh directory on fsspec's in-memory filesystem (process-wide: removed afterwards)."""
    name = f"lightning-vram-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    filesystem = fsspec.filesystem("memory")
    if filesystem.exists(f"/{name}"):
        filesystem.rm(f"/{name}", recursive=True)


@pytest.mark.figures
def test_a_remote_logger_gets_the_report_through_its_filesystem(
    tmp_path: Path, memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where a mangled local "memory:/..." directory would appear
    logger = TensorBoardLogger(f"{memory_url}/logs", name="tb")
    monitor = VramMonitor(console_summary=False, attribution_start_step=1)
    trainer(tmp_path / "root", [monitor], max_steps=2, logger=logger).fit(
        Classifier(nn.Sequential(nn.Linear(32, 10))), loader(dataset_for("linear"))
    )
    log_dir = f"{memory_url}/logs/tb/version_0"
    assert monitor.report is not None
    assert monitor.report_path == f"{log_dir}/vram_report.json"  # the URL, a string
    filesystem = fsspec.filesystem("memory")
    assert json.loads(filesystem.cat(f"{log_dir}/vram_report.json")) == monitor.report.to_dict()
    assert filesystem.cat(f"{log_dir}/vram_report.md").decode() == markdown(monitor.report)
    assert filesystem.cat(f"{log_dir}/vram_report.html").decode() == render_html(monitor.report)
    assert not [path for path in tmp_path.rglob("*") if "memory:" in str(path)]


def test_a_session_writes_to_a_url_and_a_local_dir_stays_a_path(tmp_path: Path, memory_url: str) -> None:
    remote = plain_run(f"{memory_url}/plain/")
    assert remote.report_path == f"{memory_url}/plain/vram_report.json"
    assert sorted(fsspec.filesystem("memory").ls(f"{memory_url}/plain", detail=False)) == [
        f"/{memory_url.removeprefix('memory://')}/plain/{name}" for name in sorted(FILES)
    ]
    local = plain_run(str(tmp_path))
    assert isinstance(local.report_path, Path) and local.report_path == tmp_path / "vram_report.json"
    assert plain_run(f"file://{tmp_path}/url").report_path == tmp_path / "url" / "vram_report.json"


def test_the_breakdown_tables_say_when_their_parts_were_counted(tmp_path: Path) -> None:
    report = plain_run(None).report
    assert report is not None and all(peak.breakdown is not None for peak in report.phases.values())
    note = "counted tensor by tensor where their sum peaked in the phase, not always at the peak's own moment"
    assert note in markdown(report)
    assert note.replace("'", "&#x27;") in render_html(report)
    phases = {phase: replace(peak, breakdown=None) for phase, peak in report.phases.items()}
    uncounted = replace(report, summary=replace(report.summary, phases=phases))
    assert note not in markdown(uncounted)
