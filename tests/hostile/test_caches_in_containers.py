"""The user's ``lru_cache`` reached through a container (a dict, a list, an object's attribute, the module's own
dict, a ``SimpleNamespace`` the module holds): the replay gives it a fresh cache there, as it does one a global holds;
one it cannot replace (in a tuple, a ``functools.partial``) rules the replay out, saying so. A cache of the module's
own bound method is copied over the copy's method, and replayed (it refused every replay, as reaching the model). A
class's static or class method of a cache gets a fresh one of the same kind (it was the user's).

Found attacking the escape check (twelfth session): only a cache read from a global, a closure or the module copy's
own attribute got a fresh one. Reached through a container, the replay called the user's own cache: its hits counted
the replay's calls (``cache_info`` 7 hits for 3, CPU path), and a replay at another batch size (preflight's fit
search: 16, 24, 65,536 rows) filled it with fake tensors, which the escape check cleared, the user's real entry with
them: the function ran again in training and drew new random offsets (CUDA path: losses from step 2 on 2.9357 and
2.8774 for 2.8395 and 2.9965).
"""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import OPTIMIZERS, Classifier, dataset_for, loader
from torch import nn

CALLS = {"offsets": 0, "draw": 0}


@functools.cache
def offsets(rows: int) -> torch.Tensor:
    """Random logit offsets drawn once per batch size (from the global generator), counted."""
    CALLS["offsets"] += 1
    return torch.randn(rows, 10)


TABLE = {"offsets": offsets}
LISTED = [offsets]
CHAIN = (offsets,)
BOUND = functools.partial(offsets)


class Settings:
    def __init__(self) -> None:
        self.offsets = offsets


SETTINGS = Settings()


class Shifted(Classifier):
    """The classifier, its logits shifted by the cached offsets (``self.table`` holds the cache too)."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10)), OPTIMIZERS["adam"])
        self.table = {"offsets": offsets}
        self.space = types.SimpleNamespace(offsets=offsets)

    def shifted_loss(self, batch: Any, shift: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs) + shift, targets)


class InADict(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, TABLE["offsets"](len(batch[0])))


class InAList(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, LISTED[0](len(batch[0])))


class InAnObject(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, SETTINGS.offsets(len(batch[0])))


class InTheModulesDict(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, self.table["offsets"](len(batch[0])))


class InANamespace(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, self.space.offsets(len(batch[0])))


class OfABoundMethod(Shifted):
    def __init__(self) -> None:
        super().__init__()
        self.drawn = functools.lru_cache(maxsize=None)(self.draw)

    def draw(self, rows: int) -> torch.Tensor:
        """The module's own offsets, drawn once per batch size through ``self.drawn`` (a cache of its bound method)."""
        CALLS["draw"] += 1
        return torch.randn(rows, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, self.drawn(len(batch[0])))


class AsAStaticMethod(Shifted):
    cached = staticmethod(offsets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, self.cached(len(batch[0])))


class AsAClassMethod(Shifted):
    @classmethod
    @functools.cache
    def drawn_for(cls, rows: int) -> torch.Tensor:
        CALLS["draw"] += 1
        return torch.randn(rows, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, self.drawn_for(len(batch[0])))


class InTheModulesTuple(Shifted):
    """The module's own tuple: its copy holds a fresh cache there (a tuple of the user's rules the replay out)."""

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = (offsets,)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, self.pipeline[0](len(batch[0])))


class InATuple(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, CHAIN[0](len(batch[0])))


class InAPartial(Shifted):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shifted_loss(batch, BOUND(len(batch[0])))


def drawn(module: Shifted) -> tuple[int, ...] | None:
    """What the module's own cache counted (:class:`OfABoundMethod`'s, :class:`AsAClassMethod`'s)."""
    if isinstance(module, OfABoundMethod):
        return tuple(module.drawn.cache_info())
    if isinstance(module, AsAClassMethod):
        return tuple(vars(AsAClassMethod)["drawn_for"].__func__.cache_info())
    return None


def train_both(tmp_path: Path, path: str, kind: type[Shifted]) -> Any:
    def build() -> Case:
        offsets.cache_clear()
        vars(AsAClassMethod)["drawn_for"].__func__.cache_clear()
        CALLS.update(offsets=0, draw=0)
        module = kind()
        # what the user reads: the cache's counts, the function's calls, the offsets training used
        return Case(
            module,
            loader(dataset_for("linear"), batch_size=8),
            observe=lambda: (tuple(offsets.cache_info()), drawn(module), dict(CALLS), offsets(8)),
        )

    monitor = assert_untouched(build, tmp_path, path, steps=4)
    assert monitor.report is not None and monitor.report.simulation is not None
    return monitor.report.simulation


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "kind",
    [
        InADict,
        InAList,
        InAnObject,
        InTheModulesDict,
        InTheModulesTuple,
        InANamespace,
        OfABoundMethod,
        AsAStaticMethod,
        AsAClassMethod,
    ],
)
def test_a_cache_in_a_container_gets_a_fresh_one(tmp_path: Path, path: str, kind: type[Shifted]) -> None:
    simulation = train_both(tmp_path, path, kind)
    if path == "cuda":  # the CPU path's baseline counts the fresh cache's tensor, which the real step found cached
        assert simulation.skipped is None, simulation.skipped
        assert simulation.baseline is not None
        changed = [note for note in simulation.baseline.notes if note.startswith("the replayed code changed")]
        holders = ("TABLE", "LISTED", "SETTINGS", "model.")  # got their cache back: the replay changed none
        assert not [note for note in changed if any(holder in note for holder in holders)], changed


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", [InATuple, InAPartial])
def test_a_cache_no_fresh_one_can_replace_rules_the_replay_out(tmp_path: Path, path: str, kind: type[Shifted]) -> None:
    simulation = train_both(tmp_path, path, kind)
    assert simulation.skipped is not None and "functools.lru_cache held where" in simulation.skipped
