"""Code a replay ran that the walk did not see, or whose effects outlast the replay (the fifteenth attack's gaps).

Each case's step reaches code that appends to a list of the user's: a class's ``__del__`` or a ``weakref.finalize``
callback, run as the replay's objects are collected (after the replay has put back what it changed); a user exception
class's ``__init__`` (exception classes were never walked); a class of another user module reached through
``importlib.import_module``, ``vars(module)[name]``, ``getattr(module, name)`` or an ``import`` statement in the step
(a local name the walk never followed); a class held in a ``types.MappingProxyType``; a user base's
``__init_subclass__`` run by ``dataclass(slots=True)``, a user ``EnumMeta``'s ``__new__`` run by the enum functional
API (a dataclass or an enum with no method of its own was taken for library code: the functions ``dataclasses`` and
``enum`` put in its ``__dict__`` are theirs); a dict subclass's ``__init__`` run by ``dataclasses.asdict`` imported by
name. Each trains with and without the monitor: identical. Where the effect cannot be put back the replay is refused,
and the reason names what was reached; elsewhere the replay runs.
"""

from __future__ import annotations

import enum
import gc
import importlib
import sys
import types
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, linear_net, loader
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.prediction.containment.reach import reach_of

EVENTS: list[Any] = []
"""What the user's code reached by the steps below appends to (a replay's appends must not stay)."""


def small_loader() -> Any:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    return loader(data, batch_size=8)


def scaled_loss(module: Classifier, batch: Any, scale: float) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(module(inputs) * scale, targets)


def untouched(step_class: type[Classifier], tmp_path: Path, path: str) -> VramMonitor:
    """Train ``step_class`` with and without the monitor, the events observed; the monitor of the watched run."""

    def build() -> Case:
        gc.collect()  # the previous run's objects (a trainer and its module hold each other): their __del__ runs now
        EVENTS.clear()
        return Case(step_class(linear_net()), small_loader(), observe=lambda: list(EVENTS))

    return assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)


def skipped(monitor: VramMonitor) -> str | None:
    simulation = monitor.session.simulation
    assert simulation is not None
    return simulation.skipped


class Collected:
    def __init__(self) -> None:
        self.weight = 1.0

    def __del__(self) -> None:
        EVENTS.append("collected")


class KeepsACollected(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.helper = Collected()  # the previous one is collected now: so is the replay's copy of it, and its own
        return scaled_loss(self, batch, self.helper.weight)


def _finalized(tag: str) -> None:
    EVENTS.append(tag)


class Finalized:
    def __init__(self) -> None:
        self.weight = 1.0
        weakref.finalize(self, _finalized, "finalized")


class KeepsAFinalized(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.helper = Finalized()
        return scaled_loss(self, batch, self.helper.weight)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("step_class", "named"),
    [(KeepsACollected, "Collected.__del__"), (KeepsAFinalized, "weakref.finalize")],
    ids=["__del__", "weakref.finalize"],
)
def test_code_run_as_the_replays_objects_are_collected_refuses_the_replay(
    tmp_path: Path, path: str, step_class: type[Classifier], named: str
) -> None:
    reason = skipped(untouched(step_class, tmp_path, path))
    assert reason is not None and named in reason, reason


class Skip(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        EVENTS.append(why)
        self.scale = 1.0 + 0.25 * len(EVENTS)  # the weights follow the events


def checked(batch_idx: int) -> float:
    try:
        raise Skip(f"step {batch_idx}")
    except Skip as skip:
        return skip.scale


class RaisesItsOwnError(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return scaled_loss(self, batch, checked(batch_idx))


class Maker:
    def __init__(self) -> None:
        EVENTS.append("made")
        self.weight = 1.0 + 0.25 * len(EVENTS)


REGISTRY = types.MappingProxyType({"maker": Maker})


class MakesFromAProxy(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return scaled_loss(self, batch, REGISTRY["maker"]().weight)


class Plugin:
    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__(**options)
        EVENTS.append(cls.__name__)
        cls.weight = 1.0 + 0.25 * len(EVENTS)


class Plain(Plugin):
    scale: float = 1.0


class SlotsAPlugin(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        slotted = dataclass(slots=True)(Plain)  # a new class: its base's __init_subclass__ runs
        return scaled_loss(self, batch, slotted().scale * slotted.weight)


class CountingMeta(enum.EnumMeta):
    def __new__(metacls, name: str, bases: Any, namespace: Any, **options: Any) -> Any:
        EVENTS.append(name)
        return super().__new__(metacls, name, bases, namespace, **options)


class Kind(enum.Enum, metaclass=CountingMeta):
    pass


class MakesAnEnum(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        colors: Any = Kind("Colors", "RED GREEN")  # type: ignore[call-overload]  # the functional API
        return scaled_loss(self, batch, float(len(colors)))


class Table(dict[str, float]):
    def __init__(self, *items: Any, **weights: float) -> None:
        super().__init__(*items, **weights)
        EVENTS.append("table")


@dataclass
class Settings:
    weights: Table = field(default_factory=lambda: Table(weight=1.0))


class ReadsItsSettingsAsADict(Classifier):
    def __init__(self, network: nn.Module) -> None:
        super().__init__(network)
        self.settings = Settings()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        weights = asdict(self.settings)["weights"]  # rebuilds the Table: its __init__ runs
        return scaled_loss(self, batch, weights["weight"])


CASES: dict[str, type[Classifier]] = {
    "exception __init__": RaisesItsOwnError,
    "MappingProxyType": MakesFromAProxy,
    "dataclass(slots=True)": SlotsAPlugin,
    "EnumMeta.__new__": MakesAnEnum,
    "asdict of a dict subclass": ReadsItsSettingsAsADict,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_code_the_walk_now_reaches_is_replayed_and_put_back(tmp_path: Path, path: str, case: str) -> None:
    monitor = untouched(CASES[case], tmp_path, path)
    assert skipped(monitor) is None


HELPER_SOURCE = """
EVENTS = []


class Maker:
    def __init__(self):
        EVENTS.append("made")
        self.weight = 1.0 + 0.25 * len(EVENTS)
"""

STEP_SOURCE = """
import importlib

import walk_helper
from torch import nn

from models import Classifier


class Step(Classifier):
    def training_step(self, batch, batch_idx):
        {imports}
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs) * {maker}().weight, targets)
"""
"""The step, in a module of its own (``vars`` puts every global of the step's module in reach)."""

MAKERS = {
    "importlib": ("pass", 'importlib.import_module("walk_helper").Maker'),
    "vars": ("pass", 'vars(walk_helper)["Maker"]'),
    "getattr": ("pass", 'getattr(walk_helper, "Maker")'),
    "import in the step": ("import walk_helper as helpers", "helpers.Maker"),
    "from-import in the step": ("from walk_helper import Maker", "Maker"),
}
"""How each step reaches ``Maker``: what it imports itself, and the expression."""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("form", "refused"), [(form, "importlib.import_module" if form == "importlib" else None) for form in MAKERS]
)
def test_a_class_of_another_user_module_reached_by_name(
    tmp_path: Path, path: str, form: str, refused: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "walk_helper.py").write_text(HELPER_SOURCE)
    (tmp_path / "walk_steps.py").write_text(STEP_SOURCE.format(imports=MAKERS[form][0], maker=MAKERS[form][1]))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("walk_helper", "walk_steps"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    helper, steps = importlib.import_module("walk_helper"), importlib.import_module("walk_steps")

    def build() -> Case:
        helper.EVENTS.clear()
        return Case(steps.Step(linear_net()), small_loader(), observe=lambda: list(helper.EVENTS))

    try:
        monitor = assert_untouched(
            build, tmp_path / "runs", path, attribution_start_step=0, attribution_every_n_steps=1
        )
    finally:
        for name in ("walk_helper", "walk_steps"):
            sys.modules.pop(name, None)
    reason = skipped(monitor)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason, reason


def test_an_import_in_the_step_of_a_module_not_imported_yet_refuses_only_the_user_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "walk_not_yet.py").write_text("EVENTS = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "walk_not_yet", raising=False)
    monkeypatch.delitem(sys.modules, "tabnanny", raising=False)

    def users(module: nn.Module) -> None:
        import walk_not_yet  # type: ignore[import-not-found]

        walk_not_yet.EVENTS.append(module)

    def library_and_own_modules(module: nn.Module) -> None:
        import tabnanny  # a library's, not imported yet: its state is its own

        print(tabnanny.verbose, len(list(module.modules())), file=sys.stderr)  # not sys.modules

    assert reach_of([("step", users)], set()).effects == [
        f"{users.__qualname__} imports walk_not_yet, not imported yet: a replay would run its code"
    ]
    effects = reach_of([("step", library_and_own_modules)], set()).effects  # reading sys sweeps this module's globals
    assert not [effect for effect in effects if effect.startswith(library_and_own_modules.__qualname__)], effects
    assert "walk_not_yet" not in sys.modules and "tabnanny" not in sys.modules  # the walk imported neither
