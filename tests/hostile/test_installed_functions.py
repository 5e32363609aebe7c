"""The user's own functions installed in torch's or Python's namespaces: no replay and no measurement calls them.

Found attacking 0.11.0 (2026-11-27, eighth session): a user who installs a function of theirs in a library's place
(``F.linear = counting_linear``, a wrapper that counts, then calls the original; ``torch.Tensor.add = ...``;
``builtins.print = my_print``) had it called again by each replay of the step, and by the CPU's host measurement:
a call counter read 7 after 6 training steps with the monitor. Library code the step calls reaches these names
where the replay's walk does not follow it (``nn.Linear.forward`` calls ``F.linear``, though the step never names
it), so any one rules the replay out, said in the report. Each case trains with and without the monitor and
compares exactly, the user's counter included.
"""

from __future__ import annotations

import builtins
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import PATHS, Case, assert_untouched
from installed_values import installed
from models import Classifier, dataset_for, linear_net, loader
from torch import nn

from lightning_vram import predict
from lightning_vram.prediction.timing import checkpoint_ops, host

CALLS = {"count": 0}
"""How often the user's installed functions ran: reset by each run's ``build``, read back by its ``observe``."""


def counted(original: Callable[..., Any]) -> Callable[..., Any]:
    """The user's wrapper: counts each call, then calls ``original``."""

    def counting(*args: Any, **kwargs: Any) -> Any:
        CALLS["count"] += 1
        return original(*args, **kwargs)

    return counting


def counting_print(*args: Any, **kwargs: Any) -> None:
    """The user's ``print``: counts, prints nothing."""
    CALLS["count"] += 1


class AddsOne(Classifier):
    """Adds one to its inputs with ``Tensor.add``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs.add(1.0)), targets)


class Prints(Classifier):
    """Prints each step's index."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        print("step", batch_idx)
        return super().training_step(batch, batch_idx)


def case(module_class: type[Classifier]) -> Callable[[], Case]:
    def build() -> Case:
        CALLS["count"] = 0
        return Case(module_class(linear_net()), loader(dataset_for("linear")), observe=lambda: CALLS["count"])

    return build


def site(function: Callable[..., Any]) -> str:
    return f"{Path(function.__code__.co_filename).name}:{function.__code__.co_firstlineno}"


REASON_END = (
    ": a replay would call it again. Library code the step calls (torch's own, transformers') reaches torch's and"
    " Python's functions by names the replay's walk does not follow, so a function of yours installed in their"
    " namespaces rules out every replay, whether the step names it or not"
)


def skipped(monitor: Any) -> str | None:
    report = monitor.report
    assert report is not None and report.simulation is not None
    return report.simulation.skipped  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", PATHS)
def test_a_counting_f_linear_the_step_never_names_is_not_called_again(tmp_path: Path, path: str) -> None:
    counting = counted(F.linear)
    with installed(F, "linear", counting):
        monitor = assert_untouched(case(Classifier), tmp_path, path)
    assert CALLS["count"] == 4  # nn.Linear's forward called it, once a step
    assert skipped(monitor) == f"torch.nn.functional.linear is your function counting ({site(counting)}){REASON_END}"


@pytest.mark.parametrize("path", PATHS)
def test_a_counting_f_linear_behind_lru_cache_is_not_called_again(tmp_path: Path, path: str) -> None:
    """``functools.lru_cache``'s wrapper is C's: the user's function is found by its ``__wrapped__`` (attack, ninth
    session: 7 calls for 4 on the CPU path)."""
    counting = counted(F.linear)
    with installed(F, "linear", functools.lru_cache(maxsize=None)(counting)):
        monitor = assert_untouched(case(Classifier), tmp_path, path)
    assert CALLS["count"] == 4
    assert skipped(monitor) == f"torch.nn.functional.linear is your function counting ({site(counting)}){REASON_END}"


@pytest.mark.parametrize("path", PATHS)
def test_a_counting_function_of_an_optimizer_s_module_is_not_called_again(tmp_path: Path, path: str) -> None:
    """``SGD.step`` calls its module's ``sgd`` by name: the modules of the library classes the walk passes are searched
    (attack, ninth session: 7 calls for 4 on the CPU path, 12 on the CUDA path)."""
    module = sys.modules[torch.optim.SGD.__module__]
    counting = counted(module.sgd)
    with installed(module, "sgd", counting):
        monitor = assert_untouched(case(Classifier), tmp_path, path)
    assert CALLS["count"] == 4
    assert skipped(monitor) == f"torch.optim.sgd.sgd is your function counting ({site(counting)}){REASON_END}"


@pytest.mark.parametrize("path", PATHS)
def test_a_counting_tensor_method_is_not_called_again(tmp_path: Path, path: str) -> None:
    counting = counted(torch.Tensor.add)
    with installed(torch.Tensor, "add", counting):
        monitor = assert_untouched(case(AddsOne), tmp_path, path)
    assert CALLS["count"] == 4
    assert skipped(monitor) == f"torch.Tensor.add is your function counting ({site(counting)}){REASON_END}"


@pytest.mark.parametrize("path", PATHS)
def test_a_print_of_the_users_is_not_called_again(tmp_path: Path, path: str) -> None:
    with installed(builtins, "print", counting_print):
        monitor = assert_untouched(case(Prints), tmp_path, path)
    assert CALLS["count"] == 4
    assert skipped(monitor) == f"builtins.print is your function counting_print ({site(counting_print)}){REASON_END}"


def test_predict_refuses_and_calls_none_of_it() -> None:
    torch.manual_seed(0)
    module = Classifier(linear_net())
    batch = next(iter(loader(dataset_for("linear"))))
    counting = counted(F.linear)
    CALLS["count"] = 0
    with installed(F, "linear", counting):
        prediction = predict(module, batch, device_type="cpu", fit_table=False)
    assert CALLS["count"] == 0
    assert prediction.step is None
    assert prediction.skipped == f"torch.nn.functional.linear is your function counting ({site(counting)}){REASON_END}"


def test_the_host_measurement_calls_none_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's measurement (matrix products, a tiny training step, checkpointing's overhead) is skipped instead."""
    monkeypatch.setattr(host, "_MEASURED", [])  # not measured yet in this process
    monkeypatch.setattr(checkpoint_ops, "_MEASURED", [])
    CALLS["count"] = 0
    with (
        installed(torch, "mm", counted(torch.mm)),
        installed(F, "linear", counted(F.linear)),
        installed(torch, "sin", counted(torch.sin)),
    ):
        peaks = host.measure_host_peaks({"relu"})
        overhead = checkpoint_ops.measure_checkpoint_overhead(1e-6)
    assert (peaks, overhead, CALLS["count"]) == (None, None, 0)
