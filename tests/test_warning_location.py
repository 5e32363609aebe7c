"""The monitor's warnings point at the user's own line, whichever way the monitor was reached."""

from __future__ import annotations

import runpy
import warnings
from pathlib import Path

from models import Classifier, dataset_for, loader, trainer
from torch import nn

from lightning_vram import VramMonitor
from lightning_vram.exceptions import VramMonitorWarning

SCRIPT = """
import torch
from torch import nn
from lightning_vram import VramSession
model = nn.Linear(4, 2)
session = VramSession(console_summary=False)
session.start(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
session.finish()
"""


def test_a_session_started_at_a_scripts_top_level_warns_at_that_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(str(script))
    ours = [warning for warning in caught if issubclass(warning.category, VramMonitorWarning)]
    assert ours, "the CPU run's warning"
    # Line 7 is `session.start(...)`; a fixed stacklevel ran past the stack there and Python named the place sys:1.
    assert [(Path(warning.filename), warning.lineno) for warning in ours] == [(script, 7)] * len(ours)


def test_a_monitor_under_trainer_fit_warns_at_the_fit_line(tmp_path: Path) -> None:
    monitor = VramMonitor(console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(Classifier(nn.Linear(32, 10)), loader(dataset_for("linear")))  # the line every warning names
        line = test_a_monitor_under_trainer_fit_warns_at_the_fit_line.__code__.co_firstlineno + 5
    ours = [warning for warning in caught if issubclass(warning.category, VramMonitorWarning)]
    assert ours, "the CPU run's warning"
    assert {(warning.filename, warning.lineno) for warning in ours} == {(__file__, line)}
