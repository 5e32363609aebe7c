"""The user's copy hooks (``__getstate__``, ``__setstate__``, ``__deepcopy__``) on objects the module holds.

The replay deep-copies the module, and ``deepcopy`` ran those hooks on the real objects, unguarded and never undone:
a ``__getstate__`` that popped a cache from ``self.__dict__`` took it from the real object (the losses differed from
step 2 on), a ``__setstate__`` that registered each copy grew the user's registry (1 object, then 5), a
``__deepcopy__`` that counted its copies counted 4; a LightningModule's own ``__setstate__`` ran too. Now the copy is
made as if those classes had no hooks: the replay runs, and training is bit-identical with and without the monitor,
in a Lightning run as in a plain loop's ``VramSession``. An object that does not copy without its hook (the lock its
``__getstate__`` leaves out) refuses the replay, naming the class and the hook.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched, equal
from models import Classifier, dataset_for, linear_net, loader
from torch import nn

from lightning_vram import VramSession

REGISTRY: list[Any] = []
"""Every tokenizer built or unpickled, as a global table of open resources keeps them."""


class Tokenizer:
    """Registers itself as it is built and as it is unpickled (or copied)."""

    def __init__(self) -> None:
        self.words = ["a", "b", "c"]
        REGISTRY.append(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        REGISTRY.append(self)


class Vocabulary:
    """Leaves its cache out of its pickled state by popping it from its own ``__dict__``."""

    def __init__(self) -> None:
        self.words = ["a", "b", "c"]
        self._cache = {"a": 1.0}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__
        state.pop("_cache", None)
        return state

    def weight(self) -> float:
        return getattr(self, "_cache", {}).get("a", 0.5)


class Handle:
    """Counts its copies on its class, as a wrapper around a shared resource does."""

    copies = 0

    def __init__(self) -> None:
        self.uses = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> Handle:
        type(self).copies += 1
        copied = Handle()
        copied.uses = self.uses
        return copied


class Locked:
    """Holds a lock, which its ``__getstate__`` leaves out of a copy (a lock does not copy)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"seen": self.seen}


class Holding(Classifier):
    """A classifier holding one of the objects above; its step scales the loss by the vocabulary's weight."""

    def __init__(self, held: object) -> None:
        super().__init__(linear_net())
        self.held = held

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        scale = self.held.weight() if isinstance(self.held, Vocabulary) else 1.0
        return nn.functional.cross_entropy(self(inputs), targets) * scale


class Registered(Holding):
    """A LightningModule whose own ``__setstate__`` (Lightning's, then a registration) the copy would run."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        REGISTRY.append(self)


def _observed(module: Holding) -> dict[str, Any]:
    held = module.held
    return {
        "registry": len(REGISTRY),
        "copies": Handle.copies,
        "attributes": sorted(vars(held)),
        "cache": getattr(held, "_cache", None),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", [Tokenizer, Vocabulary, Handle, Registered], ids=lambda kind: kind.__name__)
def test_the_users_copy_hooks_do_not_run_and_training_is_bit_identical(tmp_path: Path, path: str, kind: type) -> None:
    def build() -> Case:
        REGISTRY.clear()
        Handle.copies = 0
        module = Registered(Vocabulary()) if kind is Registered else Holding(kind())
        return Case(module, loader(dataset_for("linear"), batch_size=8), observe=lambda: _observed(module))

    monitor = assert_untouched(build, tmp_path, path, steps=6, attribution_start_step=1, attribution_every_n_steps=1)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert simulation.baseline is not None


def test_an_object_that_does_not_copy_without_its_hook_refuses_the_replay_naming_it(tmp_path: Path) -> None:
    def build() -> Case:
        module = Holding(Locked())
        return Case(module, loader(dataset_for("linear"), batch_size=8), observe=lambda: sorted(vars(module.held)))

    monitor = assert_untouched(build, tmp_path, "cpu", attribution_start_step=1)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is None
    assert simulation.skipped is not None and "Locked.__getstate__" in simulation.skipped, simulation.skipped


class Tokenized(nn.Module):
    """A plain module holding a tokenizer that registers its copies."""

    def __init__(self) -> None:
        super().__init__()
        self.network = linear_net()
        self.tokenizer = Tokenizer()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.network(inputs)  # type: ignore[no-any-return]


def _train_plain(session: VramSession | None) -> Any:
    torch.manual_seed(0)
    REGISTRY.clear()
    model = Tokenized()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    if session is not None:
        session.start(
            model,
            optimizers=[optimizer],
            step_function=lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1]),
        )
    for inputs, targets in loader(dataset_for("linear"), batch_size=8):
        if session is not None:
            session.batch_start((inputs, targets))
        loss = nn.functional.cross_entropy(model(inputs), targets)
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
    return model.state_dict(), optimizer.state_dict(), losses, len(REGISTRY)


def test_a_plain_loops_session_runs_no_copy_hook_of_the_users(tmp_path: Path) -> None:
    bare = _train_plain(None)
    session = VramSession(
        attribution_start_step=1, attribution_every_n_steps=1, console_summary=False, log_dir=tmp_path / "run"
    )
    watched = _train_plain(session)
    assert equal(bare, watched), (bare[3], watched[3])
    simulation = session.simulation
    assert simulation is not None and simulation.skipped is None and simulation.baseline is not None
