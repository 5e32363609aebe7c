import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_vram.config import MonitorConfig

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

# The tests' models are tiny: one intra-op thread keeps their step times steady on a busy or 2-core machine,
# where spinning worker threads otherwise stretch a millisecond step to a hundred. The processes the tests start
# (examples, CLI runs, scripts) take one too: on this 2-core machine the examples' runs of
# tests/test_session.py::test_examples_write_reports_with_exact_model_state took 8.7 s and 6.0 s with 2, 4.8 s and
# 4.5 s with 1.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

from collected import COLLECTED, Collection  # noqa: E402 -- collected.py sits beside this file, on the path above
from models import REPLAY_OPTIONS, REPLAYS_OFF, TEST_REPLAY_BUDGET_SECONDS  # noqa: E402 -- models.py sits beside this file, on the path above


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """Helper scripts beside the tests are not test modules: ``--doctest-modules`` would import them (and deepspeed)."""
    if collection_path.parent == HERE and collection_path.suffix == ".py":
        return not collection_path.name.startswith(("test_", "conftest"))
    return None


@pytest.fixture(scope="session", autouse=True)
def replay_budget_independent_of_load() -> Iterator[None]:
    """A monitor or session built in this process without naming ``replay_budget_seconds`` replays within
    ``TEST_REPLAY_BUDGET_SECONDS`` (models.py says why), fixtures of any scope included; processes the tests start keep
    the library's 30 s."""
    library_init = MonitorConfig.__init__

    def with_the_tests_budget(self: MonitorConfig, *args: Any, **options: Any) -> None:
        if not args and "replay_budget_seconds" not in options:
            options = {**options, "replay_budget_seconds": TEST_REPLAY_BUDGET_SECONDS}
        library_init(self, *args, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MonitorConfig, "__init__", with_the_tests_budget)
        yield


@pytest.fixture(autouse=True)
def replays_off_unless_asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Monitors and sessions a test builds replay nothing unless the test asks for replays.

    A replay of the sampled step and of every change it could advise costs seconds of host time per run, and most
    training tests read only what was measured: with replays off their reports carry no simulation and their advice is
    modelled. A test that reads replay output (simulated advice, the fit table, preflight, lengths replayed,
    timelines) asks with ``@pytest.mark.replay`` (the library's own defaults, ``preflight=True``, with the tests'
    replay budget: :func:`replay_budget_independent_of_load`), or names either option where it builds the monitor
    (``**REPLAYS_ON`` from models.py): what a test names stands. Fixtures of a wider scope than the test are built
    before this one is, with those defaults: a shared run that needs no replay says ``**REPLAYS_OFF``.
    ``LIGHTNING_VRAM_TEST_REPLAYS=all`` runs every test with those defaults (the whole suite as users run it, slowly).
    """
    if request.node.get_closest_marker("replay") or os.environ.get("LIGHTNING_VRAM_TEST_REPLAYS") == "all":
        yield
        return
    library_init = MonitorConfig.__init__

    def without_replays(self: MonitorConfig, *args: Any, **options: Any) -> None:
        if not args and not REPLAY_OPTIONS & options.keys():
            options = {**REPLAYS_OFF, **options}
        library_init(self, *args, **options)

    monkeypatch.setattr(MonitorConfig, "__init__", without_replays)
    yield


@pytest.fixture(autouse=True)
def figures_off_unless_asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs a test trains publish their reports without figures unless the test asks for them.

    Drawing a report's figures is the costliest part of a run's end (matplotlib lays out every text of each one):
    170 s of the suite's 1,459 s of test time (2,531 figures; 2026-11-28), in tests that read none of them. A test
    that reads a run's figures (TensorBoard images, the HTML page's, a logger's) asks with ``@pytest.mark.figures``;
    the tests of the figures themselves call the drawing functions directly. A run without figures publishes as one
    with nothing to draw: every scalar, text and file, the page without its images.
    Fixtures of a wider scope than the test are built before this one is: their runs draw figures.
    ``LIGHTNING_VRAM_TEST_FIGURES=all`` draws them in every test (the whole suite as users run it, slowly).
    """
    if request.node.get_closest_marker("figures") or os.environ.get("LIGHTNING_VRAM_TEST_FIGURES") == "all":
        yield
        return
    from lightning_vram.session import sinks  # on first use, as the tests of the package's imports need

    monkeypatch.setattr(sinks, "report_pngs", lambda report: {})
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first: those that start processes, then those that replay, then the rest (each file's tests
    stay together and in order); what the collection saw kept in ``config.stash`` (:mod:`collected`).

    ``make test`` runs ``--dist loadfile --no-loadscope-reorder``: pytest-xdist hands the files to its workers in this
    order, so the short files fill the end of the run, where a long file that came last would keep one worker busy
    while the other idles. This hook runs before ``-m`` deselects: the record holds every test collected.
    """
    weight: dict[Path, int] = {}
    for item in items:
        own = 2 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("replay") else 0
        weight[item.path] = max(weight.get(item.path, 0), own)
    items.sort(key=lambda item: -weight[item.path])
    files = {item.path: weight[item.path] == 2 for item in items if item.path.name.startswith("test_")}
    config.stash[COLLECTED] = Collection(
        frozenset(sys.modules),
        tuple((path.name, starts) for path, starts in files.items()),
        len(items),
        frozenset(str(path) for path in files),
    )


@pytest.fixture
def gloo_one_rank() -> Iterator[None]:
    """A gloo process group of one rank (this process) on a free port, destroyed after the test.

    Not torch's fake group: DDP's backward fails there (its all-reduce's future holds no tensor: "expected the hook
    result is either a Tensor or a TensorList found None", c10d/comm.cpp).
    """
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
