"""State a replay changed and 0.11.0 did not put back (issue 25, H4): each case trains with and without the monitor.

A function's attributes (``helper.calls += 1``), a ``ContextVar`` set in the step, a Python attribute on a global
tensor, and state two levels down the user's own package (``userpkg.cfg.STATE["n"] += 1``). In each the weights
follow the state, so a replay that leaves it changed trains a different model.
"""

from __future__ import annotations

import contextvars
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader
from torch import nn
from torch.utils.data import DataLoader


def cnn_loader() -> DataLoader[Any]:
    return loader(dataset_for("cnn"), batch_size=8)


def scaled_loss(module: Classifier, batch: Any, count: int) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs) * (1.0 + 0.25 * count), targets)


def helper() -> int:
    """Counts its own calls in an attribute of its own."""
    helper.calls += 1  # type: ignore[attr-defined]
    return helper.calls  # type: ignore[attr-defined,no-any-return]


class CountsInAFunctionAttribute(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return scaled_loss(self, batch, helper())


@pytest.mark.parametrize("path", PATHS)
def test_a_function_attribute_is_put_back(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        helper.calls = 0  # type: ignore[attr-defined]
        return Case(CountsInAFunctionAttribute(cnn_net()), cnn_loader(), observe=lambda: helper.calls)  # type: ignore[attr-defined]

    assert_untouched(build, tmp_path, path)


STEPS: contextvars.ContextVar[int] = contextvars.ContextVar("hostile_steps", default=0)


class CountsInAContextVar(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        STEPS.set(STEPS.get() + 1)
        return scaled_loss(self, batch, STEPS.get())


@pytest.mark.parametrize("path", PATHS)
def test_a_context_variable_is_put_back(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        STEPS.set(0)
        return Case(CountsInAContextVar(cnn_net()), cnn_loader(), observe=STEPS.get)

    assert_untouched(build, tmp_path, path)


GLOBAL_T = torch.zeros(3)


class CountsOnATensor(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        GLOBAL_T.counter = getattr(GLOBAL_T, "counter", 0) + 1  # type: ignore[attr-defined]
        return scaled_loss(self, batch, GLOBAL_T.counter)  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", PATHS)
def test_a_python_attribute_on_a_global_tensor_is_put_back(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        vars(GLOBAL_T).pop("counter", None)
        return Case(CountsOnATensor(cnn_net()), cnn_loader(), observe=lambda: GLOBAL_T.counter)  # type: ignore[attr-defined]

    assert_untouched(build, tmp_path, path)


userpkg: Any = None
"""The user's package on disk, as ``import userpkg.cfg`` binds it (the test writes it to ``tmp_path``)."""


class CountsTwoLevelsDown(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        userpkg.cfg.STATE["n"] += 1
        return scaled_loss(self, batch, userpkg.cfg.STATE["n"])


@pytest.mark.parametrize("path", PATHS)
def test_state_two_levels_down_the_users_package_is_put_back(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cfg.py").write_text('STATE = {"n": 0}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("userpkg", "userpkg.cfg"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("userpkg.cfg")
    monkeypatch.setitem(globals(), "userpkg", sys.modules["userpkg"])

    def build() -> Case:
        userpkg.cfg.STATE["n"] = 0
        return Case(CountsTwoLevelsDown(cnn_net()), cnn_loader(), observe=lambda: dict(userpkg.cfg.STATE))

    try:
        assert_untouched(build, tmp_path / "runs", path)
    finally:
        for name in ("userpkg.cfg", "userpkg"):
            sys.modules.pop(name, None)
