"""Functions compiled with ``torch.compile`` called from the step: a run with the monitor trains as one without.

Found by attacking 0.10.0: on a sampled step of a CPU run, dynamo ran a compiled function under the live count's
dispatch mode another way than in training (its losses rounded differently), and a preflight replay calling one on
fake tensors left it uncompiled for the rest of the process (no cache entry, every later call eager; ``predict()``
did the same to compiled modules). The monitor now finds such functions in the code the step reaches and treats them
as it treats a compiled module: the saved-tensor hooks count the sampled steps (dynamo runs the function the same
under them), the CPU's live count stands aside (the report says so, naming the function) and nothing is replayed
(the simulation says why). Compiled code the walk cannot see runs compiled under the live count and eagerly in a
replay. Each case also compares the function's own dynamo cache and dynamo's counters.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, Case, assert_untouched, equal
from models import Classifier, dataset_for, loader
from torch import nn
from torch._dynamo.utils import counters

from lightning_vram import Report, VramSession
from lightning_vram.predict import predict
from lightning_vram.prediction.containment.audit import audit_refusal
from lightning_vram.records import Simulation
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

# Dynamo reads `.grad` of the non-leaf tensors it traces (torch's own probe, whose warning it means to hide).
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")

BACKEND = "inductor" if shutil.which("g++") or shutil.which("clang++") else "aot_eager"
"""Inductor, what users compile with, where it can compile its C++ kernels (their rounding differs from eager's)."""


def smooth(inputs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A fused activation and normalisation, whose rounding differs between eager and inductor's kernel."""
    hidden = inputs * torch.sigmoid(1.702 * inputs)
    hidden = (hidden - hidden.mean(-1, keepdim=True)) / torch.sqrt(hidden.var(-1, keepdim=True) + 1e-5)
    return torch.tanh(hidden * scale + 0.1).exp()


fused = torch.compile(smooth, backend=BACKEND)


@pytest.fixture(autouse=True)
def _audit_hook_added() -> None:
    """Every case runs with the replay's audit hook in the process, as after any earlier replay of the process: once
    added, CPython calls it (and the collector's callback beside it) inside the compiled function too, where dynamo
    took their frames for the user's (one more frame converted with the monitor than without)."""
    assert audit_refusal() is None


def dynamo_state(function: Callable[..., Any]) -> tuple[int, dict[str, int], dict[str, int]]:
    """The compiled function's cache entries, and dynamo's frame and graph counters for the process."""
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(function.__wrapped__.__code__)  # type: ignore[attr-defined]
    return len(entries), dict(counters["frames"]), dict(counters["stats"])


def fresh_dynamo() -> None:
    """Each run compiles from scratch and counts its own frames."""
    torch._dynamo.reset()
    counters.clear()


class CallsACompiledFunction(pl.LightningModule):
    """A step through a compiled function: the module's global (``activation=None``) or its own attribute."""

    def __init__(self, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.encoder = nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.head = nn.Linear(64, 10)
        if activation is not None:
            self.activation = activation

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        hidden = self.encoder(inputs)
        hidden = self.activation(hidden, self.scale) if hasattr(self, "activation") else fused(hidden, self.scale)
        return nn.functional.cross_entropy(self.head(hidden), targets)

    def own_smooth(self, inputs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return smooth(inputs, scale)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def assert_counted_not_replayed(report: Report | None, simulation: Simulation | None, path: str, name: str) -> None:
    """Sampled steps were counted (the live count stood aside on the CPU, naming the function); nothing was replayed."""
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    assert sum(module.activation_bytes for module in report.modules) > 0  # the saved-tensor hooks counted
    reasons = [entry.reason for entry in report.not_measured]
    stood_aside = [reason for reason in reasons if "the live count stood aside" in reason]
    if path == "cpu":  # under the live count's dispatch mode dynamo runs the function eagerly, rounding otherwise
        assert len(stood_aside) == 1 and name in stood_aside[0] and "torch.compile" in stood_aside[0], reasons
    else:
        assert stood_aside == []
    assert simulation is not None and simulation.baseline is None
    assert simulation.skipped is not None and name in simulation.skipped and "torch.compile" in simulation.skipped


@pytest.mark.parametrize("first_sampled", [0, 1])  # 0: dynamo compiles it on a sampled step, under the hooks
@pytest.mark.parametrize("path", PATHS)
def test_a_module_level_compiled_function_trains_exactly_as_without_the_monitor(
    tmp_path: Path, path: str, first_sampled: int
) -> None:
    def build() -> Case:
        fresh_dynamo()
        return Case(CallsACompiledFunction(), loader(dataset_for("linear")), observe=lambda: dynamo_state(fused))

    options = {"attribution_start_step": first_sampled, "attribution_every_n_steps": 1}
    monitor = assert_untouched(build, tmp_path, path, **options)
    assert_counted_not_replayed(monitor.report, monitor.session.simulation, path, "smooth")


@pytest.mark.parametrize("held", ["function", "bound method"])
@pytest.mark.parametrize("path", PATHS)
def test_a_compiled_function_held_by_the_module_trains_exactly_as_without_the_monitor(
    tmp_path: Path, path: str, held: str
) -> None:
    def build() -> Case:
        fresh_dynamo()
        module = CallsACompiledFunction()
        compiled = torch.compile(module.own_smooth if held == "bound method" else smooth, backend=BACKEND)
        module.activation = compiled
        return Case(module, loader(dataset_for("linear")), observe=lambda: dynamo_state(compiled))

    monitor = assert_untouched(build, tmp_path, path, attribution_every_n_steps=1)
    name = "own_smooth" if held == "bound method" else "smooth"
    assert_counted_not_replayed(monitor.report, monitor.session.simulation, path, name)


class Network(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(smooth(self.encoder(inputs), self.scale))  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", PATHS)
def test_a_whole_compiled_lightning_module_trains_exactly_as_without_the_monitor(tmp_path: Path, path: str) -> None:
    """``torch.compile(lightning_module)``: Lightning unwraps it and runs its compiled ``forward`` and step methods."""

    def build() -> Case:
        fresh_dynamo()
        module = torch.compile(Classifier(Network()), backend=BACKEND)
        return Case(module, loader(dataset_for("linear")), observe=lambda: dynamo_state(module.forward))

    monitor = assert_untouched(build, tmp_path, path, attribution_every_n_steps=1)
    assert_counted_not_replayed(monitor.report, monitor.session.simulation, path, "Classifier.forward")


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.head = nn.Linear(64, 10)


def plain_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loop's step, given the module: it runs the compiled function."""
    inputs, targets = batch
    hidden = fused(module.linear(inputs), module.scale)
    return nn.functional.cross_entropy(module.head(hidden), targets)


def train_plain(session: VramSession | None) -> Any:
    fresh_dynamo()
    torch.manual_seed(0)
    model = Encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    if session is not None:
        session.start(model, optimizers=[optimizer], step_function=plain_step)
    for batch in loader(dataset_for("linear")):
        if session is not None:
            session.batch_start(batch)
        loss = plain_step(model, batch)
        losses.append(loss.detach())
        if session is not None:
            session.before_backward()
        loss.backward()  # type: ignore[no-untyped-call]
        if session is not None:
            session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        if session is not None:
            session.batch_end()
    if session is not None:
        session.finish()
    return model.state_dict(), optimizer.state_dict(), losses, torch.get_rng_state(), dynamo_state(fused)


@pytest.mark.parametrize("probe", [None, "scripted cuda"])
def test_a_plain_loop_calling_a_compiled_function_trains_exactly_as_without_the_session(
    tmp_path: Path, probe: str | None
) -> None:
    bare = train_plain(None)
    options: dict[str, Any] = {
        "attribution_start_step": 1,
        "attribution_every_n_steps": 1,
        "console_summary": False,
        "log_dir": tmp_path / "run",
    }
    if probe is not None:
        options["probe"] = ScriptedProbe([ScriptedBoundary(0, 0, 0)])
    session = VramSession(**options)
    watched = train_plain(session)
    assert equal(bare, watched)
    assert_counted_not_replayed(session.report, session.simulation, "cpu" if probe is None else "cuda", "smooth")


@pytest.mark.parametrize("compiled", ["function", "module"])
def test_predict_replays_nothing_compiled_and_the_compiled_code_still_compiles_afterwards(compiled: str) -> None:
    def build() -> nn.Module:
        fresh_dynamo()
        torch.manual_seed(0)
        if compiled == "function":
            return CallsACompiledFunction()
        module = CallsACompiledFunction(activation=smooth)
        module.encoder = torch.compile(module.encoder, backend=BACKEND)  # type: ignore[assignment]
        return module

    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))

    def train_once(module: nn.Module) -> tuple[torch.Tensor, Any]:
        loss = module.training_step(batch, 0)
        return loss.detach(), dynamo_state(fused if compiled == "function" else module.encoder.forward)

    bare = train_once(build())
    module = build()
    prediction = predict(module, batch, device_type="cpu", fit_table=False)
    assert equal(bare, train_once(module))  # the same loss, cache entries and compiled frames
    assert prediction.step is None and prediction.skipped is not None and "torch.compile" in prediction.skipped
    assert ("smooth" if compiled == "function" else "a compiled Linear (encoder)") in prediction.skipped


def train_loop_body(session: VramSession | None) -> Any:
    """A plain loop that calls the compiled function in its own body, with no step_function: the walk cannot see it."""
    fresh_dynamo()
    torch.manual_seed(0)
    model = Encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    if session is not None:
        session.start(model, optimizers=[optimizer])
    for inputs, targets in loader(dataset_for("linear")):
        if session is not None:
            session.batch_start((inputs, targets))
        loss = nn.functional.cross_entropy(model.head(fused(model.linear(inputs), model.scale)), targets)
        losses.append(loss.detach())
        if session is not None:
            session.before_backward()
        loss.backward()  # type: ignore[no-untyped-call]
        if session is not None:
            session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        if session is not None:
            session.batch_end()
    if session is not None:
        session.finish()
    return model.state_dict(), losses, dynamo_state(fused)


def test_compiled_code_the_walk_cannot_see_runs_compiled_under_the_live_count(tmp_path: Path) -> None:
    bare = train_loop_body(None)
    session = VramSession(
        attribution_start_step=0, attribution_every_n_steps=1, console_summary=False, log_dir=tmp_path / "run"
    )
    watched = train_loop_body(session)
    assert equal(bare, watched)
    report = session.report
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    assert report.peak.breakdown.other is not None  # the live count ran (nothing told it to stand aside)


class CallsThroughALibraryObject(pl.LightningModule):
    """Reaches its compiled function through a library's object (a stdlib logger), where the walk does not look."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))
        self.head = nn.Linear(64, 10)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        activation = logging.getLogger("hostile.compiled").activation
        return nn.functional.cross_entropy(self.head(activation(self.encoder(inputs), self.scale)), targets)


@pytest.mark.parametrize("path", PATHS)
def test_compiled_code_the_walk_cannot_see_runs_eagerly_in_the_replay_and_compiled_in_training(
    tmp_path: Path, path: str
) -> None:
    logger = logging.getLogger("hostile.compiled")

    def build() -> Case:
        fresh_dynamo()
        logger.activation = torch.compile(smooth, backend=BACKEND)  # type: ignore[attr-defined]
        return Case(
            CallsThroughALibraryObject(),
            loader(dataset_for("linear")),
            observe=lambda: dynamo_state(logger.activation),  # type: ignore[attr-defined]
        )

    monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    simulation = monitor.session.simulation
    # Replayed, with the function run eagerly on the fakes: its counts are eager ones, which the baseline check
    # rejects where they differ from the compiled step's (here: what the compiled graph saves for backward).
    assert simulation is not None and simulation.baseline is not None
    del logger.activation  # type: ignore[attr-defined]
