"""TensorBoard dashboard, HTML page and console summary, read back through real readers."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib import image
from models import Classifier, cnn_net, dataset_for, linear_net, loader, trainer
from scripted import MIB, scripted_steps
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin
from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin
from torch import nn

from lightning_vram import Report, VramMonitor
from lightning_vram.codec import report_from_dict
from lightning_vram.records import Phase, UtilizationReading
from lightning_vram.render.console import print_summary
from lightning_vram.render.html import render_html
from lightning_vram.render.tensorboard import FIGURE_TAGS, MONITOR_RUN, layout_for
from lightning_vram.render.text import headline, lead_lines, markdown, peak_label, peak_lines, summary_text, wrapped
from lightning_vram.testing import ScriptedProbe
from lightning_vram.units import format_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[VramMonitor, Path]:
    root = tmp_path_factory.mktemp("dashboard")
    logger = TensorBoardLogger(root, name="tb")
    monitor = VramMonitor(
        log_every_n_steps=2, attribution_start_step=1, attribution_every_n_steps=2, console_summary=False
    )
    trainer(root, [monitor], max_steps=6, logger=logger).fit(Classifier(cnn_net()), loader(dataset_for("cnn"), 16))
    return monitor, Path(logger.log_dir)


def events_of(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    events.Reload()
    return events


class WritesLayout(Callback):
    """Writes the user's Custom Scalars layout when training starts (after the monitor's fit start)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.logger.experiment.add_custom_scalars(USER_LAYOUT)  # type: ignore[union-attr]


@pytest.mark.parametrize("user_writes", ["before the monitor", "after the monitor"])
def test_a_layout_of_the_user_is_merged_with_the_monitor_s(tmp_path: Path, user_writes: str) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    callbacks: list[Callback] = [VramMonitor(console_summary=False)]
    if user_writes == "before the monitor":
        logger.experiment.add_custom_scalars(USER_LAYOUT)
    else:
        callbacks.append(WritesLayout())
    fit = trainer(tmp_path, callbacks, max_steps=2, logger=logger, log_every_n_steps=1)
    fit.fit(Classifier(cnn_net()), loader(dataset_for("cnn")))
    assert custom_scalars_tab(Path(logger.log_dir)) == {**USER_TAB, **monitor_tab(events_of(Path(logger.log_dir)))}


@pytest.mark.figures
def test_figures_are_images_in_tensorboard(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    _, log_dir = tensorboard_run
    events = events_of(log_dir / MONITOR_RUN)  # the monitor's own run: a write of its own never stops the logger's
    assert set(FIGURE_TAGS) <= set(events.Tags()["images"])
    for tag in FIGURE_TAGS:
        (picture,) = events.Images(tag)  # once, at train end
        assert picture.step == 6
        assert picture.encoded_image_string.startswith(PNG_MAGIC)
        pixels = image.imread(io.BytesIO(picture.encoded_image_string), format="png")
        assert pixels.shape[:2] == (picture.height, picture.width)
        assert pixels.std() > 0.05  # a drawing, not a blank canvas


def custom_scalars_tab(log_dir: Path) -> dict[str, dict[str, list[str]]]:
    """The layout TensorBoard's Custom Scalars tab shows for ``log_dir`` (its plugin merges every run's layout)."""
    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(str(log_dir))
    runs.Reload()
    provider = data_provider.MultiplexerDataProvider(runs, str(log_dir))
    plugin = CustomScalarsPlugin(base_plugin.TBContext(data_provider=provider, multiplexer=runs, logdir=str(log_dir)))
    layout = json.loads(plugin.layout_impl(context.RequestContext(), experiment="") or "{}")
    return {
        category["title"]: {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
        for category in layout.get("category", [])
    }


def monitor_tab(events: EventAccumulator) -> dict[str, dict[str, list[str]]]:
    """The monitor's charts in the Custom Scalars tab: those of :data:`LAYOUT` that show a scalar logged."""
    layout = layout_for(set(events.Tags()["scalars"]))
    return {title: {chart: spec[1] for chart, spec in charts.items()} for title, charts in layout.items()}


USER_LAYOUT = {"My losses": {"train and validation": ["Multiline", ["train_loss", "val_loss"]]}}
USER_TAB = {"My losses": {"train and validation": ["train_loss", "val_loss"]}}


def test_custom_scalars_layout_groups_the_charts(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    _, log_dir = tensorboard_run
    events = events_of(log_dir)
    categories = custom_scalars_tab(log_dir)
    assert categories == monitor_tab(events)
    assert categories["VRAM memory"]["allocated, reserved and step peak (MiB)"] == [
        "vram/allocated_mib",
        "vram/reserved_mib",
        "vram/peak_mib",
    ]
    # No chart of a metric never logged: the CPU measures no GPU utilization.
    assert "GPU utilization (percent)" not in categories["VRAM speed"]
    assert set(categories["VRAM speed"]) == {"data wait (fraction of step time)", "step time (seconds)"}
    # The layout's tags name scalars that were logged (on CPU: those measured there), in MiB beside the bytes.
    logged = set(events.Tags()["scalars"])
    assert {"vram/peak_bytes", "vram/peak_mib", "vram/data_wait_fraction"} <= logged
    (peak_bytes, *_), (peak_mib, *_) = events.Scalars("vram/peak_bytes"), events.Scalars("vram/peak_mib")
    assert peak_mib.value == pytest.approx(peak_bytes.value / 2**20)


def test_advice_text_is_written_once_at_the_last_step(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    _, log_dir = tensorboard_run
    steps = [event.step for event in events_of(log_dir / MONITOR_RUN).Tensors("vram/advice/text_summary")]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # the epoch ends at 4; the run and its last epoch at 6


class PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.external: list[str] = []
        self.text: list[str] = []
        self.advice_ids: list[str] = []
        self.module_cells: list[str] = []
        self._in_modules = False
        self._in_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in ("src", "href"):
            value = values.get(name) or ""
            if value.startswith(("http:", "https:", "//")):
                self.external.append(value)
        if tag == "img":
            self.images.append(values.get("src") or "")
        if tag == "div" and "advice" in (values.get("class") or ""):
            self.advice_ids.append(values.get("id") or "")
        if tag == "table" and values.get("id") == "modules":
            self._in_modules = True
        self._in_code = tag == "code"

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_modules = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._in_modules and self._in_code:
            self.module_cells.append(data)


@pytest.mark.figures
def test_html_page_is_self_contained_and_complete(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    monitor, log_dir = tensorboard_run
    report = monitor.report
    assert report is not None
    page = (log_dir / "vram_report.html").read_text()
    assert page == render_html(report)
    parser = PageParser()
    parser.feed(page)
    assert parser.external == []
    assert len(parser.images) == 4 and all(src.startswith("data:image/png;base64,") for src in parser.images)
    text = " ".join(parser.text)
    assert "Live peak " in text and f"of step {report.peak.step}" in text  # type: ignore[union-attr]
    assert parser.module_cells == [row.name for row in report.modules]
    assert parser.advice_ids == [item.id for item in report.advice]
    for item in report.advice:
        assert item.evidence in text


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium package is not installed")
def test_html_page_renders_in_headless_chromium(tensorboard_run: tuple[VramMonitor, Path], tmp_path: Path) -> None:
    _, log_dir = tensorboard_run
    screenshot = tmp_path / "page.png"
    command = [
        "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={screenshot}", "--window-size=1000,1400",
        (log_dir / "vram_report.html").as_uri(),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    pixels = image.imread(str(screenshot))
    assert pixels.shape[:2] == (1400, 1000)
    assert pixels.std() > 0.05  # text and figures, not an empty page


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_table_on_a_terminal_and_plain_text_elsewhere(
    tensorboard_run: tuple[VramMonitor, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tensorboard_run[0].report
    assert report is not None
    terminal = Terminal()
    monkeypatch.setenv("COLUMNS", "80")  # a part per row, a phase per column: no header is cut at 80 columns
    print_summary(report, terminal, written_to="logs/vram_report.json")
    table = re.sub(r"\x1b\[[0-9;]*m", "", terminal.getvalue())  # drop the terminal's colour codes
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 80  # the lines too, not only the table
    shown = table.splitlines()
    top = next(index for index, line in enumerate(shown) if line[:1] == "┏")
    assert shown[:top] == lead_lines(report, 80)  # the device, the headline and the advice above the table
    header = next(line for line in table.splitlines() if "phase's peak" in line)
    cells = [cell.strip() for cell in header.split("┃")[1:-1]]
    assert cells == ["at each phase's peak", "forward", "backward", "optimizer"]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == [
        peak_label(report), "parameters", "gradients", "optimizer state", "activations", "other"
    ]  # fmt: skip
    assert format_bytes(report.phases[Phase.FORWARD].peak_bytes) in rows[0]
    plain = summary_text(report, written_to="logs/vram_report.json").splitlines()
    held = {part for line in peak_lines(report) for part in wrapped(f"  {line}", 80)}
    assert len(held) >= 2 and held <= set(plain)
    assert [line for line in plain if line not in held] == [
        line for line in table.splitlines() if line[:1] not in "┏┃┡│└"
    ]
    # the plain text's lines, but the breakdown and the phase peaks, which the table holds
    assert "  report written to logs/vram_report.json" in table.splitlines()
    piped = io.StringIO()
    print_summary(report, piped)
    assert piped.getvalue().startswith("VRAM report:") and "┃" not in piped.getvalue()
    monkeypatch.setitem(sys.modules, "rich.console", None)  # rich not installed
    without_rich = Terminal()
    print_summary(report, without_rich)
    assert without_rich.getvalue() == piped.getvalue()


def test_report_round_trips_through_json(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    report = tensorboard_run[0].report
    assert report is not None
    rebuilt: Report = report_from_dict(report.to_dict())
    assert rebuilt.to_dict() == report.to_dict()
    failed = replace(report, ended_with="KeyError: 'labels'")
    read = report_from_dict(json.loads(json.dumps(failed.to_dict())))
    assert read.ended_with == "KeyError: 'labels'" and read.to_dict() == failed.to_dict()


@pytest.mark.figures
def test_html_page_puts_the_headline_and_advice_first(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    monitor, log_dir = tensorboard_run
    report = monitor.report
    assert report is not None and report.timing.step_seconds_median is not None
    page = (log_dir / "vram_report.html").read_text()
    advice = page.index("<h2>Advice</h2>")
    assert page.index("class='headline'") < advice < page.index("<h2>Breakdown") < page.index("<img")
    meta = re.search(r"<p class='meta'>(.*?)</p>", page)
    assert meta is not None
    assert f"; step {1000 * report.timing.step_seconds_median:.1f} ms median, data wait " in meta.group(1)


def test_capacity_on_the_cpu_is_called_host_ram(tensorboard_run: tuple[VramMonitor, Path]) -> None:
    report = tensorboard_run[0].report
    assert report is not None and report.device.type == "cpu" and report.peak is not None
    capacity = format_bytes(report.device.total_bytes)
    share = f"% of {capacity} host RAM) in {report.peak.phase.value}"
    terminal = Terminal()
    print_summary(report, terminal)
    table = re.sub(r"\s+", " ", re.sub(r"\x1b\[[0-9;]*m|[│┃]", "", terminal.getvalue()))  # the title may wrap
    for rendered in (headline(report), summary_text(report), markdown(report), render_html(report), table):
        assert share in rendered
    assert f"capacity {capacity} host RAM;" in markdown(report) and f"capacity {capacity} host RAM;" in render_html(
        report
    )
    on_a_gpu = replace(report, summary=replace(report.summary, device=replace(report.device, type="cuda")))
    assert f"% of {capacity}) in " in headline(on_a_gpu) and "host RAM" not in markdown(on_a_gpu)


def test_modules_tied_on_bytes_keep_the_order_they_ran_in(tmp_path: Path) -> None:
    blocks = nn.Sequential(*(nn.Linear(32, 32) for _ in range(12)))  # each saves its 8 x 32 float32 input
    monitor = VramMonitor(console_summary=False, attribution_start_step=1, top_modules=11)
    trainer(tmp_path, [monitor], max_steps=2).fit(Classifier(blocks), loader(dataset_for("linear")))
    report = monitor.report
    assert report is not None
    # The loss's own saved tensors come first; then the first ten blocks (by name, 10 and 11 would come before 2).
    in_order = ["(training_step)"] + [f"network.{index}" for index in range(10)]
    assert [row.name for row in report.modules] == in_order
    assert {row.activation_bytes for row in report.modules[1:]} == {8 * 32 * 4}
    rows = [line for line in markdown(report).splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in rows] == in_order
    parser = PageParser()
    parser.feed(render_html(report))
    assert parser.module_cells == in_order


def test_the_utilization_chart_appears_where_utilization_is_logged(tmp_path: Path) -> None:
    steps = [(300 * MIB, 350 * MIB, 200 * MIB)] * 2
    probe = ScriptedProbe(scripted_steps(steps), utilization=[UtilizationReading(40.0, 700 * MIB)])
    monitor = VramMonitor(probe=probe, log_every_n_steps=1, attribution_start_step=100, console_summary=False)
    logger = TensorBoardLogger(tmp_path, name="tb")
    run = trainer(tmp_path, [monitor], max_steps=2, logger=logger)
    run.fit(Classifier(linear_net()), loader(dataset_for("linear")))
    charts = custom_scalars_tab(Path(logger.log_dir))
    assert charts["VRAM speed"]["GPU utilization (percent)"] == ["vram/gpu_utilization_percent"]
    assert charts["VRAM memory"]["allocated, reserved and step peak (MiB)"] == [
        "vram/allocated_mib",
        "vram/reserved_mib",
        "vram/peak_mib",
    ]
    (allocated, *_) = events_of(Path(logger.log_dir)).Scalars("vram/allocated_mib")
    assert allocated.value == 100  # MiB, where a chart of bytes shows 1.05e+08
