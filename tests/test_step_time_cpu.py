"""The issue's check: the predicted step time on this CPU within 25% of the measured one.

For the README's quickstart CNN, a GPT-2-class model (transformers' GPT2Config, small, built without downloads) and
an LSTM language model (a new user's trial: its fused LSTM kernel counted 0 FLOPs, predicted/measured 0.59), by
``benchmarks/step_time.py``: each step replayed once with its ops counted, then measured for real in rounds, the
CPU's peaks measured right before each round's steps in the same process, on one torch thread, by this process's
CPU time (a shared machine's other work lengthens wall time by however long the scheduler keeps the process
waiting). The median of the rounds' ratios is asserted; both figures are printed. A measured duration is asserted
here, as the issue asks (this project's tests otherwise never do): the ``timing`` marker lets a loaded CI leave it
out (``-m "not timing"``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timing

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "step_time.py"
TOLERANCE = 0.25
"""How far the prediction may be from the measured step time, as a share of the measured."""


def benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("step_time_benchmark", BENCHMARK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["quickstart CNN", "GPT-2 (2 layers, 128 wide)", "LSTM LM (2 layers, 256 wide)"])
def test_the_predicted_step_time_is_within_a_quarter_of_the_measured(name: str) -> None:
    steps = benchmark()
    comparison = steps.compare(name, rounds=5, steps=3)
    print(comparison.summary())
    assert abs(comparison.ratio - 1) <= TOLERANCE, comparison.summary()
