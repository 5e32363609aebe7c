"""Every logger of the Trainer gets what it can hold, read back from the logger's own files, offline.

TensorBoard has its own tests (test_dashboard.py, test_callback.py); here: CSV, W&B, MLflow, Comet, a logger of an
unknown kind, and VramSession with publishers of its own.
"""

from __future__ import annotations

import html
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CometLogger, CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from logger_files import comet_messages, csv_rows, wandb_history, wandb_records
from models import Classifier, dataset_for, linear_net, loader, trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from typing_extensions import override

from lightning_vram import Publisher, VramMonitor, VramMonitorWarning, VramSession
from lightning_vram.records import Report
from lightning_vram.render.step_memory import step_memory_figure
from lightning_vram.render.tensorboard import ADVICE_TAG, FIGURE_TAGS, MONITOR_RUN, STEP_MEMORY_TAG

MIB = 2**20
REPORT_FILES = {"vram_report.json", "vram_report.md", "vram_report.html"}
LOGGED_AT = [1, 3, 5]
"""Lightning's own logging steps of 6 batches logged every 2 (batches that stepped before each: 1, 3, 5)."""


class LogsLoss(Classifier):
    """Logs its loss with ``self.log``, at Lightning's own step."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def fit(root: Path, logger: Logger | list[Logger]) -> VramMonitor:
    """Six batches (four an epoch), scalars every two, attribution on the sampled steps."""
    monitor = VramMonitor(
        log_every_n_steps=2, attribution_start_step=1, attribution_every_n_steps=2, console_summary=False
    )
    run = trainer(root, [monitor], max_steps=6, logger=logger, log_every_n_steps=2)
    run.fit(LogsLoss(linear_net()), loader(dataset_for("linear"), 16))
    return monitor


def report_json(monitor: VramMonitor) -> dict[str, Any]:
    assert monitor.report is not None and monitor.report_path is not None
    written: dict[str, Any] = json.loads(Path(monitor.report_path).read_text())
    assert written == monitor.report.to_dict()
    return written


def peak_mib(monitor: VramMonitor) -> float:
    assert monitor.report is not None and monitor.report.peak is not None
    return monitor.report.peak.peak_bytes / MIB


def drawn_tags(report: Report | None) -> list[str]:
    """The figures a report draws: the three always, and memory during one step where its replay was trusted."""
    assert report is not None
    return [*FIGURE_TAGS, *([STEP_MEMORY_TAG] if step_memory_figure(report) is not None else [])]


def advice_ids(monitor: VramMonitor) -> list[str]:
    assert monitor.report is not None and monitor.report.advice  # the tiny model's stale gradients, at least
    return [item.id for item in monitor.report.advice]


# ----------------------------------------------------------------------------------------------- CSV


def test_csv_rows_hold_the_scalars_at_lightning_s_steps_and_each_run_keeps_its_report(tmp_path: Path) -> None:
    monitors = [fit(tmp_path, CSVLogger(tmp_path, name="csv")) for _ in range(2)]
    for version, monitor in enumerate(monitors):
        log_dir = tmp_path / "csv" / f"version_{version}"
        rows = csv_rows(log_dir / "metrics.csv")
        vram_steps = [int(row["step"]) for row in rows if row["vram/peak_mib"]]
        loss_steps = [int(row["step"]) for row in rows if row["train_loss"]]
        assert vram_steps == loss_steps == LOGGED_AT
        peaks = [(float(row["vram/peak_bytes"]), float(row["vram/peak_mib"])) for row in rows if row["vram/peak_mib"]]
        assert all(mib == pytest.approx(nbytes / MIB) for nbytes, mib in peaks)
        assert monitor.report_path == log_dir / "vram_report.json"
        assert {path.name for path in log_dir.iterdir()} >= REPORT_FILES
        report_json(monitor)  # neither run's report overwritten by the other


# ----------------------------------------------------------------------------------------------- W&B


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def wandb_run(root: Path) -> tuple[VramMonitor, Path]:
    import wandb

    logger = WandbLogger(save_dir=str(root), project="vram")
    monitor = fit(root, logger)
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    wandb.teardown()  # waits for wandb's service to write the whole run-<id>.wandb file
    return monitor, run_dir


@pytest.mark.figures
@pytest.mark.replay  # the figures published include memory during one step, drawn from the replay; the advice too
@pytest.mark.usefixtures("wandb_offline")
def test_wandb_offline_run_holds_scalars_figures_advice_files_tags_and_peak(tmp_path: Path) -> None:
    monitor, run_dir = wandb_run(tmp_path)
    files = run_dir / "files"
    assert monitor.report_path == files / "vram_report.json"
    report_json(monitor)
    (log,) = run_dir.glob("run-*.wandb")
    records = wandb_records(log)
    history = wandb_history(records)
    vram_steps = [row["trainer/global_step"] for row in history if "vram/peak_mib" in row]
    loss_steps = [row["trainer/global_step"] for row in history if "train_loss" in row]
    assert vram_steps == loss_steps == LOGGED_AT
    for tag in FIGURE_TAGS:  # once each, at the end
        (image,) = [row for row in history if f"{tag}/_type" in row]
        assert image[f"{tag}/_type"] == "images/separated" and image["trainer/global_step"] == 6
        (png,) = image[f"{tag}/filenames"]
        assert (files / png).read_bytes().startswith(b"\x89PNG")
    advice = [row for row in history if f"{ADVICE_TAG}/_type" in row]
    assert [row["trainer/global_step"] for row in advice] == [4, 6]  # each epoch's end; the last one the run's end
    page = (files / advice[-1][f"{ADVICE_TAG}/path"]).read_text()
    assert monitor.report is not None and all(html.escape(item.title) in page for item in monitor.report.advice)
    saved = [
        file.path for record in records if record.WhichOneof("record_type") == "files" for file in record.files.files
    ]
    assert set(saved) >= REPORT_FILES
    tags = [list(record.run.tags) for record in records if record.WhichOneof("record_type") == "run"]
    assert tags[-1] == advice_ids(monitor)
    summary = {
        "/".join(item.nested_key) or item.key: json.loads(item.value_json)
        for record in records
        if record.WhichOneof("record_type") == "summary"
        for item in record.summary.update
    }
    assert summary["vram/peak_mib"] == pytest.approx(peak_mib(monitor))


@pytest.mark.usefixtures("wandb_offline")
def test_two_wandb_runs_in_one_save_dir_keep_two_reports(tmp_path: Path) -> None:
    (first, first_dir), (second, second_dir) = wandb_run(tmp_path), wandb_run(tmp_path)
    assert first_dir != second_dir
    assert report_json(first)["steps"] == report_json(second)["steps"] == 6


# ----------------------------------------------------------------------------------------------- MLflow


def mlflow_run(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[VramMonitor, MLFlowLogger]:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, local and offline
    logger = MLFlowLogger(tracking_uri=f"file:{root / 'mlruns'}")
    return fit(root, logger), logger


@pytest.mark.figures
@pytest.mark.replay  # the figures published include memory during one step, drawn from the replay; the advice too
def test_mlflow_run_holds_scalars_figures_advice_files_and_tags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monitor, logger = mlflow_run(tmp_path, monkeypatch)
    run_id = logger.run_id
    assert run_id is not None
    experiment_id = logger.experiment_id
    assert experiment_id is not None
    # The run's own artifact folder: the files are its artifacts as written, and the store's root stays MLflow's.
    assert monitor.report_path == tmp_path / "mlruns" / experiment_id / run_id / "artifacts" / "vram_report.json"
    report_json(monitor)
    client = MlflowClient(f"file:{tmp_path / 'mlruns'}")
    assert REPORT_FILES | {"vram"} <= {item.path for item in client.list_artifacts(run_id)}
    figures = {item.path for item in client.list_artifacts(run_id, "vram/figures")}
    assert figures == {f"{tag}.png" for tag in drawn_tags(monitor.report)}
    advice = Path(client.download_artifacts(run_id, f"{ADVICE_TAG}.md", str(tmp_path / "download"))).read_text()
    assert monitor.report is not None and all(item.title in advice for item in monitor.report.advice)
    vram_steps = [metric.step for metric in client.get_metric_history(run_id, "vram/peak_mib")]
    loss_steps = [metric.step for metric in client.get_metric_history(run_id, "train_loss")]
    assert vram_steps == loss_steps == LOGGED_AT
    tags = client.get_run(run_id).data.tags
    assert tags["vram.advice"] == ",".join(advice_ids(monitor))
    assert all(tags[f"vram.advice.{advice_id}"] == "true" for advice_id in advice_ids(monitor))
    assert float(tags["vram.peak_mib"]) == pytest.approx(peak_mib(monitor), rel=1e-5)
    assert monitor.report is not None and monitor.report.peak is not None
    assert tags["vram.peak_bytes"] == str(monitor.report.peak.peak_bytes)  # exact, not rounded to 6 digits


def test_two_mlflow_runs_in_one_store_keep_two_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (first, _), (second, _) = mlflow_run(tmp_path, monkeypatch), mlflow_run(tmp_path, monkeypatch)
    assert first.report_path != second.report_path
    assert report_json(first)["steps"] == report_json(second)["steps"] == 6


# ----------------------------------------------------------------------------------------------- Comet


@pytest.mark.figures
@pytest.mark.replay  # the figures published include memory during one step, drawn from the replay; the advice too
def test_comet_offline_archive_holds_scalars_figures_advice_assets_and_tags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CometLogger(online=False) disables the experiment (Lightning 2.6 sets ``disabled``): comet_ml's own switch
    # makes the offline one. Lightning sets COMET_DISABLE_AUTO_LOGGING itself; setting it here restores it after.
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    monkeypatch.setenv("COMET_AUTO_LOG_GIT_METADATA", "false")
    monkeypatch.setenv("COMET_AUTO_LOG_ENV_DETAILS", "false")  # no host details (its IP lookup leaves a socket open)
    offline = tmp_path / "comet"
    offline.mkdir()
    logger = CometLogger(project="vram", offline_directory=str(offline))
    monitor = fit(tmp_path, logger)
    key = logger.experiment.get_key()
    logger.experiment.end()  # writes the archive
    assert monitor.report_path == offline / f"vram_{key}" / "vram_report.json"
    report_json(monitor)
    messages, experiment = comet_messages(offline)
    metrics = [message["payload"]["metric"] for message in messages if message["type"] == "metric_msg"]
    vram_steps = [metric["step"] for metric in metrics if metric["metricName"] == "vram/peak_mib"]
    loss_steps = [metric["step"] for metric in metrics if metric["metricName"] == "train_loss"]
    assert vram_steps == loss_steps == LOGGED_AT
    uploads = [message["payload"] for message in messages if message["type"] == "file_upload"]
    figures = [upload["additional_params"] for upload in uploads if upload["upload_type"] == "visualization"]
    assert sorted(figure["figName"] for figure in figures) == sorted(drawn_tags(monitor.report))
    assert {figure["step"] for figure in figures} == {6}
    texts = [upload for upload in uploads if upload["upload_type"] == "text-sample"]
    assert [(text["metadata"]["name"], text["additional_params"]["step"]) for text in texts] == [
        (ADVICE_TAG, 4),
        (ADVICE_TAG, 6),
    ]
    assets = {upload["additional_params"]["fileName"] for upload in uploads if upload["upload_type"] == "asset"}
    assert assets == REPORT_FILES
    assert experiment["tags"] == advice_ids(monitor)
    others = {
        message["payload"]["key"]: message["payload"]["value"] for message in messages if message["type"] == "log_other"
    }
    assert others["vram/peak_mib"] == pytest.approx(peak_mib(monitor))


# ----------------------------------------------------------------------------------------------- others


class ListLogger(Logger):
    """A logger of a kind the monitor does not know: it keeps what ``log_metrics`` gets."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    @override
    def name(self) -> str:
        return "list"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_a_logger_of_an_unknown_kind_gets_the_scalars_and_one_warning(tmp_path: Path) -> None:
    logger = ListLogger()
    with pytest.warns(VramMonitorWarning, match="ListLogger gets the vram/... scalars only") as caught:
        monitor = fit(tmp_path, [logger, CSVLogger(tmp_path, name="csv")])
    assert len([item for item in caught if "scalars only" in str(item.message)]) == 1
    assert [step for step, metrics in logger.logged if "vram/peak_mib" in metrics] == LOGGED_AT
    assert [step for step, metrics in logger.logged if "train_loss" in metrics] == LOGGED_AT
    assert monitor.report_path == tmp_path / "csv" / "version_0" / "vram_report.json"  # the next logger's folder


class Recording(Publisher):
    """A publisher of the user's own: keeps every call."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self.calls.append(("scalars", step))

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        self.calls.append(("image", (name, pixels.shape[2], step)))

    def text(self, name: str, markdown: str, step: int) -> None:
        self.calls.append(("text", (name, step)))

    def artifacts(self, paths: Sequence[Path]) -> None:
        self.calls.append(("artifacts", sorted(path.name for path in paths)))

    def tags(self, ids: Sequence[str]) -> None:
        self.calls.append(("tags", list(ids)))

    def summary(self, values: Mapping[str, float]) -> None:
        self.calls.append(("summary", sorted(values)))


class Failing(Recording):
    name = "failing"

    def image(self, name: str, pixels: np.ndarray, step: int) -> None:
        raise OSError("disk full")


@pytest.mark.figures
@pytest.mark.replay  # the figures published include memory during one step, drawn from the replay; the advice too
def test_a_session_publishes_to_its_publishers_and_one_that_fails_is_switched_off(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recording, failing = Recording(), Failing()
    session = VramSession(log_dir=tmp_path, log_every_n_steps=2, console_summary=False, attribution_start_step=1)
    session.start(model, [optimizer], publishers=[failing, recording])
    for step in range(4):
        batch = torch.randn(2, 8)
        session.batch_start(batch)
        loss = model(batch).sum()
        session.before_backward()
        loss.backward()  # type: ignore[no-untyped-call]
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        scalars = session.batch_end(step=100 + step)
        # What a plain loop writes itself: every value in bytes with its MiB twin, which the layout charts.
        in_bytes = {name[: -len("_bytes")]: value for name, value in scalars.items() if name.endswith("_bytes")}
        assert {f"{name}_mib": value / 2**20 for name, value in in_bytes.items()}.items() <= scalars.items()
        assert bool(in_bytes) == bool(scalars)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = session.finish()
    assert report is not None
    ours = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
    assert len(ours) == 1 and "publishing to failing failed with OSError: disk full" in ours[0]
    assert [value for kind, value in recording.calls if kind == "scalars"] == [101, 103]
    images = [value for kind, value in recording.calls if kind == "image"]
    assert [name for name, _, _ in images] == [
        tag for tag in drawn_tags(report) if tag != FIGURE_TAGS[2] or report.modules
    ]
    assert {(channels, step) for _, channels, step in images} == {(3, 103)}
    assert ("artifacts", sorted(REPORT_FILES)) in recording.calls
    assert ("summary", ["vram/peak_bytes", "vram/peak_mib"]) in recording.calls
    assert [kind for kind, _ in failing.calls] == ["scalars", "scalars"]  # off after its first failure
    assert any(item.what == "publishing to failing" for item in report.not_measured)


@pytest.mark.figures
@pytest.mark.usefixtures("wandb_offline")
def test_with_wandb_and_tensorboard_each_gets_everything_and_the_files_are_written_once(tmp_path: Path) -> None:
    import wandb

    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    monitor = fit(tmp_path, [WandbLogger(save_dir=str(tmp_path), project="vram"), tensorboard])
    wandb.finish()
    wandb.teardown()
    (files,) = (tmp_path / "wandb").glob("offline-run-*/files")
    assert monitor.report_path == files / "vram_report.json"  # the first logger's run folder
    report_json(monitor)
    assert not list(Path(tensorboard.log_dir).glob("vram_report.*"))  # written once
    events = EventAccumulator(tensorboard.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert [event.step for event in events.Scalars("vram/peak_mib")] == LOGGED_AT
    own = EventAccumulator(str(Path(tensorboard.log_dir) / MONITOR_RUN), size_guidance={"images": 0, "tensors": 0})
    own.Reload()
    assert set(FIGURE_TAGS) <= set(own.Tags()["images"])
    assert [event.step for event in own.Tensors(f"{ADVICE_TAG}/text_summary")] == [4, 6]
    (log,) = files.parent.glob("run-*.wandb")
    history = wandb_history(wandb_records(log))
    assert all(any(f"{tag}/_type" in row for row in history) for tag in FIGURE_TAGS)
