"""VramSession without a Trainer: a plain loop gives the callback's report; the examples run and count exactly."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import (
    FLOAT32,
    OPTIMIZERS,
    PARAMETER_COUNTS,
    Classifier,
    cnn_net,
    dataset_for,
    linear_net,
    loader,
    trainer,
)
from preloaded_python import run_script
from sessions import new_session, plain_run, train_steps
from test_guard import FailingProbe
from torch import nn

from lightning_vram import VramMonitor, VramMonitorWarning, VramSession
from lightning_vram.records import Phase

EXAMPLES = Path(__file__).parent.parent / "examples"
TIMING_FIELDS = ("step_seconds_median", "data_wait_fraction", "step_time_iqr_fraction")


def plain_loop(session: VramSession, module: Classifier, steps: int) -> None:
    """Lightning's automatic optimization, written out: forward, zero_grad, backward, step."""
    optimizer = module.configure_optimizers()
    data = loader(dataset_for("cnn"))
    session.start(module, optimizers=[optimizer], dataloader=data)
    train_steps(session, module, optimizer, data, steps)
    session.finish()


def without_timing(value: Any) -> Any:
    """The report without host times: the timing section's, the replay's seconds, and reasons quoting the data wait."""
    if isinstance(value, dict):
        if value.get("id") == "dataloader-workers" and "reason" in value:  # not advised: "data wait is 0.7% ..."
            return {key: item for key, item in value.items() if key != "reason"}
        return {key: without_timing(item) for key, item in value.items() if key not in (*TIMING_FIELDS, "seconds")}
    if isinstance(value, list):
        return [without_timing(item) for item in value]
    return value


@pytest.mark.replay  # the two reports' simulations are compared
def test_monitor_and_session_give_the_same_report_on_the_same_training(tmp_path: Path) -> None:
    options: dict[str, Any] = {"attribution_start_step": 1, "attribution_every_n_steps": 2, "console_summary": False}
    torch.manual_seed(0)
    monitor = VramMonitor(**options)
    trainer(tmp_path / "trainer", [monitor], max_steps=5).fit(
        Classifier(cnn_net(), OPTIMIZERS["adam"]), loader(dataset_for("cnn"))
    )
    torch.manual_seed(0)
    session = VramSession(log_dir=tmp_path / "plain", **options)
    plain_loop(session, Classifier(cnn_net(), OPTIMIZERS["adam"]), steps=5)

    assert monitor.report is not None and session.report is not None
    by_trainer, by_session = monitor.report.to_dict(), session.report.to_dict()
    assert by_trainer["steps"] == by_session["steps"] == 5
    assert by_trainer["phases"]["forward"]["breakdown"]["parameters"] == PARAMETER_COUNTS["cnn"] * FLOAT32
    assert by_trainer["simulation"]["baseline"]["matches"] and by_session["simulation"]["baseline"]["matches"]
    assert json.loads((tmp_path / "plain" / "vram_report.json").read_text()) == by_session
    # A precision change replays with autocast's weight cache as each loop's autocast has it: off under the Trainer's
    # plugin, on under a plain loop's `torch.autocast` (one cast of a weight held and shared through the forward pass).
    cached = {}
    for name, report in (("trainer", by_trainer), ("session", by_session)):
        precision = [variant for variant in report["simulation"]["variants"] if variant["kind"] == "precision"]
        assert precision, name
        cached[name] = [variant.pop("phases") for variant in precision]
    assert cached["trainer"] != cached["session"]  # the forward pass differs by the cast weights the cache keeps
    assert without_timing(by_trainer) == without_timing(by_session)


def test_session_returns_interval_scalars_at_each_interval_end() -> None:
    session = VramSession(log_every_n_steps=2, attribution_start_step=0, attribution_every_n_steps=1)
    module = Classifier(cnn_net())
    optimizer = module.configure_optimizers()
    session.start(module, optimizers=[optimizer])
    returned = []
    for step, batch in enumerate(loader(dataset_for("cnn"))):
        if step == 4:
            break
        session.batch_start(batch)
        loss = module.training_step(batch, step)
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        returned.append(dict(session.batch_end()))
    report = session.finish(gather_ranks=False)
    assert [bool(scalars) for scalars in returned] == [False, True, False, True]
    assert report is not None and report.peak is not None
    assert returned[3]["vram/peak/parameters_bytes"] == PARAMETER_COUNTS["cnn"] * FLOAT32
    assert returned[1]["vram/phase_peak/optimizer_bytes"] > 0
    assert not any(name.startswith("vram/allocated") for name in returned[3])  # not measured on the CPU


def tiny_transformer_parameters(width: int = 64, vocabulary: int = 1000, layers: int = 2) -> tuple[int, int]:
    """(elements, tensors) of examples/plain_pytorch.py's TinyTransformer, from the layer formulas (DOMAIN.md)."""
    feedforward = 4 * width
    layer = (3 * width * width + 3 * width) + (width * width + width)  # attention in/out projections
    layer += (feedforward * width + feedforward) + (width * feedforward + width) + 2 * (2 * width)  # FFN, norms
    elements = vocabulary * width + layers * layer + (width * 10 + 10)
    return elements, 1 + 12 * layers + 2


def small_cnn_parameters() -> tuple[int, int]:
    """(elements, tensors) of examples/fabric_loop.py's small CNN."""
    elements = (3 * 32 * 9 + 32) + 2 * 32 + (32 * 64 * 9 + 64) + 2 * 64 + (64 * 10 + 10)
    return elements, 10


@pytest.mark.parametrize(
    ("script", "parameters"),
    [("plain_pytorch.py", tiny_transformer_parameters), ("fabric_loop.py", small_cnn_parameters)],
)
def test_examples_write_reports_with_exact_model_state(tmp_path: Path, script: str, parameters: Any) -> None:
    arguments = ("--log-dir", str(tmp_path), "--steps", "6", "--batch-size", "8")
    completed = run_script(EXAMPLES / script, *arguments, timeout=900)  # only a hang takes 900 s, even under load
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads((tmp_path / "vram_report.json").read_text())
    elements, tensors = parameters()
    parameter_bytes = elements * FLOAT32
    optimizer = report["phases"][Phase.OPTIMIZER.value]["breakdown"]
    assert report["steps"] == 6
    assert optimizer["parameters"] == parameter_bytes
    assert optimizer["gradients"] == parameter_bytes  # every gradient is alive when the optimizer steps
    # Adam(W): two moments per parameter and one 4-byte `step` tensor per parameter tensor.
    assert optimizer["optimizer_state"] == 2 * parameter_bytes + FLOAT32 * tensors
    # zero_grad() sets gradients to None: the forward pass sees none.
    assert report["phases"][Phase.FORWARD.value]["breakdown"]["gradients"] == 0
    assert (tmp_path / "vram_report.md").exists() and (tmp_path / "vram_report.html").exists()


STEP_METHODS = (
    "batch_start",
    "before_backward",
    "after_backward",
    "before_optimizer_step",
    "after_optimizer_step",
    "batch_end",
)


@pytest.mark.parametrize("method", STEP_METHODS)
def test_a_step_method_before_start_says_start_comes_first(method: str) -> None:
    # A loop that forgot start() would otherwise get an empty report and no hint.
    message = rf"^VramSession\.{method}\(\) needs start\(\) first: call session\.start\(model, optimizers\) once"
    session = VramSession()
    with pytest.raises(RuntimeError, match=message):
        getattr(session, method)()
    with pytest.raises(TypeError):  # a start() that refuses its arguments starts nothing
        session.start("not a module")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=message):
        getattr(session, method)()
    # Ending a session never started stays quiet (a Trainer's on_exception can come before on_fit_start).
    assert session.finish() is None
    session.close()
    session.fail(RuntimeError("not started"))
    assert session.report is None


def test_step_methods_out_of_order_after_start_do_nothing() -> None:
    session = new_session()
    model = nn.Linear(4, 2)
    session.start(model)
    session.before_backward()  # no step running: ignored, as before start() they raise
    session.after_backward()
    session.before_optimizer_step()
    session.after_optimizer_step()
    assert session.batch_end() == {}
    assert session.finish() is not None


def test_a_model_without_parameters_reports_zero_model_state(tmp_path: Path) -> None:
    session = VramSession(log_dir=tmp_path, attribution_start_step=0, console_summary=False)
    model = nn.ReLU()
    session.start(model)
    session.batch_start(torch.ones(2, 3))
    model(torch.ones(2, 3, requires_grad=True)).sum()
    session.before_backward()
    session.batch_end()
    report = session.finish()
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    assert report.peak.breakdown.parameters == 0


def test_a_fabric_wrapped_optimizer_is_named_as_the_users() -> None:
    from lightning.fabric import Fabric

    from lightning_vram.measure.setup import training_setup

    network = nn.Linear(4, 2)
    _, optimizer = Fabric(accelerator="cpu", devices=1).setup(network, torch.optim.AdamW(network.parameters()))
    assert type(optimizer).__name__ == "FabricAdamW"  # Fabric's wrapper class
    assert training_setup(network, [optimizer]).optimizers == ("AdamW",)


def _warned(run: Callable[[], object]) -> list[str]:
    """The monitor's warnings while ``run`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]


def test_warnings_name_the_object_the_user_made(tmp_path: Path) -> None:
    cpu = "the model trains on cpu, not a CUDA GPU"
    # A plain loop's session on the CPU, and one whose probe fails: the user made a VramSession, never a VramMonitor.
    ours = _warned(lambda: plain_run(None))
    said = [message for message in ours if cpu in message]
    assert len(said) == 1 and said[0].startswith(f"VramSession: {cpu}")
    session = VramSession(probe=FailingProbe("read_allocator"), console_summary=False)
    module = Classifier(linear_net())
    optimizer = module.configure_optimizers()
    data = loader(dataset_for("linear"))
    session.start(module, optimizers=[optimizer], dataloader=data)
    failing = _warned(lambda: train_steps(session, module, optimizer, data, steps=2))
    assert len(failing) == 1 and failing[0].startswith("VramSession: allocator readings failed with Boom")
    assert ours and not any(message.startswith("VramMonitor") for message in ours + failing)
    # The same warning under a Trainer names the callback.
    monitor = VramMonitor(console_summary=False)
    fit = trainer(tmp_path, [monitor], max_steps=2)
    by_trainer = _warned(lambda: fit.fit(Classifier(linear_net()), loader(dataset_for("linear"))))
    assert any(message.startswith(f"VramMonitor: {cpu}") for message in by_trainer)
    assert not any(message.startswith("VramSession") for message in by_trainer)
