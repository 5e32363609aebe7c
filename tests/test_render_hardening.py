"""Report files that cannot be written, remote log dirs, and the user's text that must never become markup."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from markdown_it import MarkdownIt
from markdown_it.token import Token
from models import Classifier, dataset_for, loader, trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_vram import Report, VramMonitor, VramSession
from lightning_vram.cli import main
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.render import files as files_module
from lightning_vram.render.console import print_summary
from lightning_vram.render.figures import MAX_MODULE_BARS, modules_figure, png_bytes
from lightning_vram.render.html import render_html
from lightning_vram.render.markup import one_line
from lightning_vram.render.tensorboard import FIGURE_TAGS
from lightning_vram.render.text import markdown
from lightning_vram.testing import SCRIPTED_DEVICE, ScriptedBoundary, ScriptedProbe

FILES = ("vram_report.json", "vram_report.md", "vram_report.html")
MIB = 1024**2


def plain_run(log_dir: str | Path | None, network: nn.Module | None = None, steps: int = 3) -> VramSession:
    """A few steps of a small MLP through VramSession, without a Trainer."""
    torch.manual_seed(0)
    module = Classifier(network or nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)))
    optimizer = module.configure_optimizers()
    data = loader(dataset_for("linear"))
    session = VramSession(log_dir=log_dir, attribution_start_step=1, attribution_every_n_steps=1, console_summary=False)
    session.start(module, optimizers=[optimizer], dataloader=data)
    for step, batch in enumerate(data):
        if step == steps:
            break
        session.batch_start(batch)
        loss = module.training_step(batch, step)
        optimizer.zero_grad()
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        session.batch_end()
    session.finish()
    return session


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
    def broken_page(report: Report) -> str:
        raise RuntimeError("the figure could not be drawn")

    monkeypatch.setattr(files_module, "render_html", broken_page)
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
    new_json = (json.dumps(session.report.to_dict(), indent=2) + "\n").encode()
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


@pytest.fixture
def file_size_limit() -> Iterator[int]:
    """The kernel refuses writes beyond 16 KiB (RLIMIT_FSIZE): a real part-way failure, EFBIG."""
    resource = pytest.importorskip("resource")
    limit = 16 * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_file_size_limit_leaves_no_truncated_page(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    session = plain_run(None)
    assert session.report is not None
    limit = 16 * 1024
    assert len(render_html(session.report)) > limit > len(markdown(session.report))
    assert request.getfixturevalue("file_size_limit") == limit
    with pytest.raises(files_module.FilesNotWritten, match=r"vram_report\.html: File too large"):
        files_module.write_report_files(session.report, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["vram_report.json", "vram_report.md"]
    assert json.loads((tmp_path / "vram_report.json").read_text()) == session.report.to_dict()


# ------------------------------------------------------------------------------------------------ remote log dirs


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh directory on fsspec's in-memory filesystem (process-wide: removed afterwards)."""
    name = f"lightning-vram-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    filesystem = fsspec.filesystem("memory")
    if filesystem.exists(f"/{name}"):
        filesystem.rm(f"/{name}", recursive=True)


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


# --------------------------------------------------------------------------------- the user's text is never markup

HOSTILE_NAMES = (
    "a`<img src=x onerror=alert(1)>|b",
    "x\n| injected | row |\n<script>alert(1)</script>",
    "$\\undefinedcommand$",
    "[click](javascript:alert(1))",
    "``",
    "*a* _b_ \\| c &amp; <!-- d",
)
HOSTILE_CLASS = type("Evil`|<b>bold</b>\n# heading $\\frac{1}{0$", (nn.Linear,), {})
HOSTILE_DEVICE = replace(SCRIPTED_DEVICE, name="GPU [/bold] [link=https://x]y[/link] <i>z</i> | `w`")


def hostile_network() -> nn.Sequential:
    network = nn.Sequential()
    for name in HOSTILE_NAMES:
        network.add_module(name, nn.Linear(32, 32))
    network.add_module("typed", HOSTILE_CLASS(32, 32))
    network.add_module("activation", nn.ReLU())
    network.add_module("head", nn.Linear(32, 10))
    return network


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[VramMonitor, Path]:
    root = tmp_path_factory.mktemp("hostile")
    logger = TensorBoardLogger(root, name="tb")
    boundary = ScriptedBoundary(allocated_bytes=10 * MIB, reserved_bytes=20 * MIB, highest_bytes=12 * MIB)
    monitor = VramMonitor(
        console_summary=False, attribution_start_step=1, probe=ScriptedProbe([boundary], device=HOSTILE_DEVICE)
    )
    trainer(root, [monitor], max_steps=2, logger=logger).fit(
        Classifier(hostile_network()), loader(dataset_for("linear"))
    )  # with warnings as errors: a renderer that raised would have failed the guard's warning
    return monitor, Path(logger.log_dir)


def all_tokens(tokens: list[Token]) -> Iterator[Token]:
    for token in tokens:
        yield token
        yield from all_tokens(token.children or [])


def table_rows(tokens: list[Token], table: int) -> list[list[list[Token]]]:
    """The body rows of the ``table``-th table: each row a list of cells, each cell its inline tokens."""
    tables = [index for index, token in enumerate(tokens) if token.type == "table_open"]
    rows: list[list[list[Token]]] = []
    in_body = False
    for token in tokens[tables[table] :]:
        if token.type == "table_close":
            break
        in_body = in_body or token.type == "tbody_open"
        if in_body and token.type == "tr_open":
            rows.append([])
        if in_body and token.type == "inline":
            rows[-1].append(token.children or [])
    return rows


def test_hostile_names_in_markdown_stay_text_and_keep_the_table(hostile_run: tuple[VramMonitor, Path]) -> None:
    monitor, log_dir = hostile_run
    report = monitor.report
    assert report is not None
    hostile = {f"network.{name}" for name in HOSTILE_NAMES} | {"network.typed"}
    assert {row.name for row in report.modules} >= hostile  # every hostile module is in the table
    text = (log_dir / "vram_report.md").read_text()
    tokens = MarkdownIt("commonmark", {"html": True}).enable("table").parse(text)
    kinds = {token.type for token in all_tokens(tokens)}
    assert not kinds & {"html_inline", "html_block", "link_open", "image"}
    headings = [tokens[index + 1].content for index, token in enumerate(tokens) if token.type == "heading_open"]
    assert not [heading for heading in headings if heading.startswith("heading")]  # none from a class name
    rows = table_rows(tokens, 1)
    assert len(rows) == len(report.modules)
    for row, module in zip(rows, report.modules, strict=True):
        assert len(row) == 3  # module | type | saved: no cell split off, no row added
        (code,) = row[0]
        assert code.type == "code_inline" and code.content.strip() == one_line(module.name)
        assert "".join(token.content for token in row[1]) == one_line(module.type)
    device_line = next(line for line in text.splitlines() if line.startswith("Device: "))
    (inline,) = [token for token in MarkdownIt("commonmark", {"html": True}).parse(device_line) if token.children]
    assert {token.type for token in inline.children or []} == {"text"}
    assert HOSTILE_DEVICE.name in "".join(token.content for token in inline.children or [])


class Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.cells: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_hostile_names_in_html_figures_and_console_stay_text(hostile_run: tuple[VramMonitor, Path]) -> None:
    monitor, log_dir = hostile_run
    report = monitor.report
    assert report is not None
    page = Elements()
    page.feed((log_dir / "vram_report.html").read_text())
    assert page.tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "div", "table"} | {
        "tr", "th", "td", "code", "strong", "img", "pre", "ul", "li"
    }  # fmt: skip
    for module in report.modules:
        assert module.name in page.cells and module.type in page.cells
    events = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    events.Reload()
    assert set(FIGURE_TAGS) <= set(events.Tags()["images"])  # drawn, with "$...$" in labels
    terminal = Terminal()
    print_summary(report, terminal)
    assert f"{HOSTILE_DEVICE.name} (cuda)" in terminal.getvalue()  # rich printed it, markup and all, as text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_modules_figure_stays_bounded_with_many_long_names() -> None:
    session = plain_run(None)
    assert session.report is not None
    (row,) = session.report.modules[:1]
    rows = [replace(row, name=f"blocks.{index}." + "$x" * 3000) for index in range(500)]
    figure = modules_figure(rows)
    _, height = figure.get_size_inches()
    assert height == pytest.approx(0.4 * MAX_MODULE_BARS + 1.2)
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    assert len(labels) == MAX_MODULE_BARS and labels[-1].startswith("blocks.0.$x") and len(labels[-1]) == 60
    assert png_bytes(figure).startswith(b"\x89PNG")


def test_a_name_with_a_lone_surrogate_is_written_and_read_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    network = nn.Sequential(nn.Linear(32, 16))
    network.add_module("\ud800", nn.Linear(16, 10))  # no UTF-8 form: files and figures write it as an escape
    session = plain_run(tmp_path, network)
    assert session.report is not None and "network.\ud800" in {row.name for row in session.report.modules}
    assert sorted(os.listdir(tmp_path)) == sorted(FILES)
    assert "network.\\ud800" in (tmp_path / "vram_report.md").read_text()
    assert main(["show", str(tmp_path)]) == 0
    assert "network.\\ud800 (Linear)" in capsys.readouterr().out
    assert main(["html", str(tmp_path), "-o", str(tmp_path / "page.html")]) == 0
    assert (tmp_path / "page.html").read_bytes() == (tmp_path / "vram_report.html").read_bytes()
