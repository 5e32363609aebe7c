"""A disk that fills up under TensorBoard's event files.

Found by the fourth hostile round: the monitor wrote its figures and advice through the logger's own
``SummaryWriter``; a write of theirs that failed (no space left) stopped the writer's background thread, and
Lightning's ``finalize`` at the end of fit raised the error again, out of ``trainer.fit``: a run the monitor broke.
Here only the monitor's events fail (a nearly full disk takes the logger's small scalars, not a figure of hundreds of
KiB): training must end as without the monitor, the user's own scalars all in the logger's run, and one warning.
When every write fails, Lightning's own writer fails the run with or without the monitor, the same way.
"""

from __future__ import annotations

import errno
import itertools
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched, monitor_for, train
from lightning.pytorch.loggers import TensorBoardLogger
from models import Classifier, linear_net, loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitorWarning

# A failed write stops the event file writer's background thread with the error: threading reports it, as it would.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

WRITER_THREAD = "_AsyncWriterThread"
"""The class of TensorBoard's event file writer's background thread."""
MONITOR_TAGS = (b"vram/figures", b"vram/advice")
"""What the monitor writes itself, as its events hold it."""


@pytest.fixture(autouse=True)
def writer_threads_ended() -> Iterator[None]:
    """Each event file writer's thread that stopped on a failed write has ended before its test does.

    threading reports the thread's error when the thread ends. On a loaded machine one ended after its test, and pytest
    reported it at the set-up of the next test on the same worker, where this module's filter does not apply.
    """
    before = set(threading.enumerate())
    yield
    for thread in set(threading.enumerate()) - before:
        if type(thread).__name__ == WRITER_THREAD and thread.is_alive():
            thread.join(timeout=60)  # a thread stopping on its error ends at once; only a healthy one waits it out


class LogsItsLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("user_loss", loss)
        return loss


def no_space(failing: tuple[bytes, ...] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event file write of an event holding one of ``failing`` (``None``: every write) fails with ENOSPC."""
    write = RecordWriter.write

    def full(self: RecordWriter, data: bytes) -> None:
        if failing is None or any(tag in data for tag in failing):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, data)

    monkeypatch.setattr(RecordWriter, "write", full)


def case_with_a_tensorboard_logger(root: Path) -> Iterator[Case]:
    for run in itertools.count():
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        logger = TensorBoardLogger(root / f"logs{run}", name="tb", version=0)

        def user_scalars(logger: TensorBoardLogger = logger) -> list[tuple[int, float]]:
            events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
            events.Reload()
            return [(event.step, event.value) for event in events.Scalars("user_loss")]

        yield Case(
            LogsItsLoss(linear_net()),
            loader(data, batch_size=8),
            observe=user_scalars,
            trainer_options={"logger": logger, "log_every_n_steps": 1},
        )


@pytest.mark.parametrize("path", PATHS)
def test_the_monitor_s_writes_failing_leave_the_logger_and_the_run_alone(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_space(MONITOR_TAGS, monkeypatch)
    cases = case_with_a_tensorboard_logger(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = assert_untouched(lambda: next(cases), tmp_path, path)
    failed = [
        str(w.message) for w in caught if issubclass(w.category, VramMonitorWarning) and "TensorBoard" in str(w.message)
    ]
    assert failed == [
        "VramMonitor: publishing to TensorBoard failed with OSError: [Errno 28] No space left on device. It is off for"
        " the rest of the run; training goes on and the report lists it under not_measured."
    ]
    assert monitor.report is not None and "publishing to TensorBoard" in [m.what for m in monitor.report.not_measured]
    assert (tmp_path / "logs1" / "tb" / "version_0" / "vram_report.json").is_file()  # the files are written


@pytest.mark.parametrize("monitored", [False, True])
def test_a_full_disk_fails_lightning_s_own_writer_with_or_without_the_monitor(
    tmp_path: Path, monitored: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_space(None, monkeypatch)
    cases = case_with_a_tensorboard_logger(tmp_path)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device"):
        train(lambda: next(cases), tmp_path, monitor_for("cpu") if monitored else None)
