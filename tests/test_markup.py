"""The user's text is never markup: hostile module, class and device names stay text in every rendering."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from markdown_it import MarkdownIt
from markdown_it.token import Token
from models import Classifier, dataset_for, loader, trainer
from sessions import FILES, plain_run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.cli import main
from lightning_vram.render.console import print_summary
from lightning_vram.render.figures import MAX_MODULE_BARS, modules_figure, png_bytes
from lightning_vram.render.markup import one_line
from lightning_vram.render.tensorboard import FIGURE_TAGS, MONITOR_RUN
from lightning_vram.testing import SCRIPTED_DEVICE, ScriptedBoundary, ScriptedProbe

MIB = 1024**2

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


@pytest.mark.figures
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
    events = EventAccumulator(str(log_dir / MONITOR_RUN), size_guidance={"images": 0})  # the monitor's own run
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


@pytest.mark.figures
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
