"""A module compiled in place (``module.compile()``: its hooks run inside its graph), or with a compiled ``forward``.

Found by attacking 0.11.0's first cut: the monitor's module and saved-tensor hooks ran inside the compiled
``_call_impl``, so dynamo traced the monitor's own code: the user's backend received graphs it never gets without the
monitor, torch warned about tracing ``data_ptr``, and attribution failed for the run.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, loader
from torch import nn
from torch.utils.data import TensorDataset

GRAPHS: list[int] = []


def counting(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """A backend of the user's: counts what it is given, runs it as it is."""
    GRAPHS.append(len(list(graph.graph.nodes)))
    return graph.forward


def build_case(how: str) -> Case:
    GRAPHS.clear()
    torch._dynamo.reset()
    network = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    if how == "compile()":
        network.compile(backend=counting)
    else:
        network.forward = torch.compile(network.forward, backend=counting)  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    return Case(Classifier(network), loader(data), observe=lambda: list(GRAPHS))


@pytest.mark.parametrize("how", ["compile()", "compiled forward"])
@pytest.mark.parametrize("path", PATHS)
def test_a_module_compiled_in_place_is_compiled_and_trained_as_without_the_monitor(
    tmp_path: Path, path: str, how: str
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = assert_untouched(
            lambda: build_case(how), tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1
        )
    traced = [str(item.message) for item in caught if "Dynamo does not know how to trace" in str(item.message)]
    assert traced == []
    assert monitor.report is not None
    if how == "compile()":  # the module's own hooks would run inside its graph: counting stands aside
        assert any("compiled in place" in item.reason for item in monitor.report.not_measured)
    assert not [item for item in monitor.report.not_measured if "failed" in item.reason]
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None  # a compiled graph is not replayed
