"""A training step that logs through Python's ``logging``: replayed, and nothing it logs is written twice.

The walk of the user's code reached a handler's stream (``logging.basicConfig``'s ``sys.stderr``, a file) and,
taking it for an iterator whose state a replay cannot put back, refused every replay of such a run: its advice fell
back to modelled. A replay's records are dropped by every handler (the replay's filter on each), so a handler's
stream is never written by it and its formatter never runs; the handler's own filters, which run before the
replay's and may be the user's, are still walked. (Under pytest, a handler's formatter holds the terminal's file too.)
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader

STREAM = io.StringIO()
LOG = logging.getLogger("lightning_vram_tests.logged_step")


class Kept(logging.Handler):
    """Keeps every record's message, and counts its formatting calls on a class attribute."""

    formatted: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        Kept.formatted += 1
        self.messages.append(self.format(record))


KEPT = Kept()


class Logged(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        LOG.info("step %d: loss %s", batch_idx, "computed")
        return loss


@pytest.fixture(autouse=True)
def handlers() -> Any:
    stream_handler = logging.StreamHandler(STREAM)
    LOG.addHandler(stream_handler)
    LOG.addHandler(KEPT)
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    yield
    LOG.removeHandler(stream_handler)
    LOG.removeHandler(KEPT)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_logs_is_replayed_and_logs_as_often(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        STREAM.seek(0)
        STREAM.truncate()
        KEPT.messages.clear()
        Kept.formatted = 0
        return Case(
            Logged(cnn_net()),
            loader(dataset_for("cnn"), batch_size=8),
            observe=lambda: (STREAM.getvalue(), list(KEPT.messages), Kept.formatted),
        )

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert STREAM.getvalue().count("loss computed") == 4
