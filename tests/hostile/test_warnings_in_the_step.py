"""A step that warns: the replays of it (silenced, inside the monitor's hooks) take no warning away from the run.

Python shows a warning once per place under its default filter, and marks it shown in the warning's module registry
as it shows it, whoever silenced the showing. A replay that runs the step before the step itself (the CUDA path's
preflight, at step 0's start) must not use up the user's first warning: the user sees it once, as without the
monitor.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, dataset_for, linear_net, loader


class WarnsEachStep(Classifier):
    """Warns in every training step, from one place with one text (shown once under the default filter)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        warnings.warn("the step's own warning", UserWarning, stacklevel=1)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("action", ["default", "module", "once", "always"])
@pytest.mark.parametrize("path", PATHS)
def test_the_step_s_warnings_are_shown_as_without_the_monitor(tmp_path: Path, path: str, action: str) -> None:
    shown: list[int] = []

    def build() -> Case:
        caught = warnings.catch_warnings(record=True)  # a fresh registry for each run (the filters change)
        record = caught.__enter__()
        warnings.simplefilter(action)

        def observe() -> int:
            caught.__exit__(None, None, None)
            shown.append(sum(str(entry.message) == "the step's own warning" for entry in record))
            return shown[-1]

        return Case(WarnsEachStep(linear_net()), loader(dataset_for("linear")), observe=observe)

    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=1, attribution_every_n_steps=1)
    assert shown[0] == (4 if action == "always" else 1)
    assert monitor.report is not None and monitor.report.simulation is not None
    assert monitor.report.simulation.skipped is None
