"""What a default fit costs beside its training, by count (issue 24, item 8): ``benchmarks/whole_fit.py --parts``
times each of the monitor's parts per monitored fit; here the counts of a short quickstart fit on the CPU are pinned:
how often the step is replayed, the report built, its figures drawn and its files written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.session import sinks

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "whole_fit.py"


def benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("whole_fit_benchmark", BENCHMARK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.replay
@pytest.mark.figures
def test_a_default_quickstart_fit_replays_seven_times_and_draws_its_figures_once(tmp_path: Path) -> None:
    whole_fit = benchmark()
    build, loader = whole_fit.MODELS["quickstart"](64, False, None)
    parts: dict[str, object] = {}
    replay, pngs = Predictor.__dict__["replay"], sinks.report_pngs
    whole_fit.fit_seconds(build, loader, False, 3, str(tmp_path / "bare"), parts)
    assert parts == {}  # a bare fit has no parts
    whole_fit.fit_seconds(build, loader, True, 3, str(tmp_path / "monitored"), parts)
    calls = {label: part.calls for label, part in parts.items()}  # type: ignore[attr-defined]
    assert calls == {
        "preflight (before step 0)": 1,  # on the CPU it replays nothing: no longest length, no device memory
        "sampled step: replays and trials": 1,
        "  the step and each change": 1,
        "  fit table": 0,  # searched on CUDA only
        "    searches in the simulator": 0,
        "    scans in the simulator": 0,
        # The step, then each change a rule declared: bf16-mixed, three checkpointing plans, in-place ReLUs and
        # gradients freed before forward. No replay runs twice.
        "replays (each; preflight's too)": 7,
        "end-of-run report": 2,  # on_train_end builds it; the fit's end finds it built
        "  figures": 1,  # drawn once, for the TensorBoard images and the HTML page alike
        "  files": 1,
    }
    assert Predictor.__dict__["replay"] is replay and sinks.report_pngs is pngs  # the timers are taken off after
