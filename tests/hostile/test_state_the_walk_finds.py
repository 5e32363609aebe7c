"""State the replay's code reaches in less obvious ways: each case trains with and without the monitor, exactly.

Found by attacking 0.8.0's first cut: objects with ``__slots__``, ``array.array``, ``globals()[...]``, a class
handed to the module, a weak reference, an object whose ``__deepcopy__`` returns itself, a list inside a NumPy object
array, a tensor of several elements updated in place, an ``lru_cache`` held as a module attribute, the environment
and torch's thread count; an iterator drawn from in the step is refused (a replay would draw from it for real).
"""

from __future__ import annotations

import array
import functools
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchmetrics
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, loader
from torch import nn
from torch.utils.data import DataLoader


def cnn_loader() -> DataLoader[Any]:
    return loader(dataset_for("cnn"), batch_size=8)


class Slotted:
    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class Registry:
    """A class handed to the module: its class attribute is the user's, shared by every copy."""

    seen: list[int] = []  # noqa: RUF012 -- the user's registry, on purpose


class SharedHandle:
    """An object whose deep copy is itself (a handle to a resource)."""

    def __init__(self) -> None:
        self.count = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedHandle:
        return self


class Tracker:
    def __init__(self) -> None:
        self.count = 0


SLOTTED = Slotted()
SAMPLES = array.array("d")
TOTAL = 0
CENTER = torch.zeros(10)


class TouchesEverything(Classifier):
    def __init__(self, handle: SharedHandle, registry: type[Registry], tracker: Tracker) -> None:
        super().__init__(cnn_net())
        self.handle, self.registry, self.tracker = handle, registry, weakref.ref(tracker)
        self.objects = np.empty(1, dtype=object)
        self.objects[0] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        SLOTTED.count += 1
        SAMPLES.append(float(batch_idx))
        globals()["TOT" + "AL"] += 1
        self.handle.count += 1
        self.registry.seen.append(batch_idx)
        tracker = self.tracker()
        assert tracker is not None
        tracker.count += 1
        self.objects[0].append(batch_idx)
        inputs, targets = batch
        logits = self(inputs)
        CENTER.mul_(0.9).add_(logits.detach().mean(0), alpha=0.1)  # a DINO-style centre, outside the module
        return nn.functional.cross_entropy(logits - CENTER, targets)


@pytest.mark.parametrize("path", PATHS)
def test_state_reached_by_slots_arrays_computed_names_classes_handles_and_tensors(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global TOTAL
        SLOTTED.count, TOTAL = 0, 0
        del SAMPLES[:]
        Registry.seen = []
        CENTER.zero_()
        handle, tracker = SharedHandle(), Tracker()
        module = TouchesEverything(handle, Registry, tracker)

        def observe() -> Any:
            counts = (SLOTTED.count, TOTAL, handle.count, tracker.count)
            return counts, list(SAMPLES), list(Registry.seen), list(module.objects[0]), CENTER.clone()

        return Case(module, cnn_loader(), observe=observe)

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
    assert any("put back" in note for note in simulation.baseline.notes)


AUXILIARY: Any = None


class DrawsFromAnIterator(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs + next(AUXILIARY)), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_draws_from_an_iterator_is_not_replayed(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global AUXILIARY
        AUXILIARY = iter([0.0] * 6)  # enough for the real steps only: a replay drawing from it would end training
        return Case(DrawsFromAnIterator(cnn_net()), cnn_loader(), observe=lambda: list(AUXILIARY))

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None
    assert "AUXILIARY" in simulation.skipped and "cannot save and put back" in simulation.skipped


CALLS = {"vocabulary": 0}


@functools.cache
def cached_mask(size: int) -> torch.Tensor:
    return torch.ones(size)


@functools.cache
def vocabulary(size: int) -> list[int]:
    """A cache of the user's that training never reads: no replay may clear it."""
    CALLS["vocabulary"] += 1
    return list(range(size))


class HoldsACachedFunction(Classifier):
    def __init__(self) -> None:
        super().__init__(cnn_net())
        self.mask = cached_mask  # reached only through the module's attribute

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs) * self.mask(10), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_cache_held_as_a_module_attribute_is_fresh_in_the_replay(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        cached_mask.cache_clear()
        vocabulary.cache_clear()
        CALLS["vocabulary"] = 0
        vocabulary(3)

        def observe() -> Any:
            vocabulary(3)
            return CALLS["vocabulary"], cached_mask.cache_info(), vocabulary.cache_info(), type(cached_mask(10))

        return Case(HoldsACachedFunction(), cnn_loader(), observe=observe)

    assert_untouched(build, tmp_path, path)


class ChangesTheProcess(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        os.environ["HOSTILE_STEPS"] = str(int(os.environ.get("HOSTILE_STEPS", "0")) + 1)
        torch.set_num_threads(1 + batch_idx % 2)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_the_environment_and_the_thread_count_are_put_back(tmp_path: Path, path: str) -> None:
    threads = torch.get_num_threads()

    def build() -> Case:
        os.environ.pop("HOSTILE_STEPS", None)
        torch.set_num_threads(threads)
        return Case(
            ChangesTheProcess(cnn_net()),
            cnn_loader(),
            observe=lambda: (os.environ.get("HOSTILE_STEPS"), torch.get_num_threads()),
        )

    try:
        assert_untouched(build, tmp_path, path)
    finally:
        os.environ.pop("HOSTILE_STEPS", None)
        torch.set_num_threads(threads)


class WithAMetric(Classifier):
    """A torchmetrics metric as a submodule: its ``update`` wrapper is rebound to the copy, not the real module."""

    def __init__(self) -> None:
        super().__init__(cnn_net())
        self.error = torchmetrics.MeanSquaredError()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        self.error.update(logits.detach().softmax(-1).max(-1).values, torch.ones(len(targets)))
        return nn.functional.cross_entropy(logits, targets)


def test_a_metric_submodule_is_replayed_on_the_copy(tmp_path: Path) -> None:
    def build() -> Case:
        module = WithAMetric()
        return Case(module, cnn_loader(), observe=lambda: (module.error.sum_squared_error.clone(), module.error.total))

    monitor = assert_untouched(build, tmp_path, "cpu")
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
