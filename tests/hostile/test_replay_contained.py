"""The replay runs the user's code a second time: nothing that code reaches outside the replay's copy may change.

Each case trains with and without the monitor (same seed) and compares weights, losses, optimizer state, global
generators and the user's own objects exactly, on the CPU path and on the CUDA path (scripted probe: a preflight
replay before step 0 too).
"""

from __future__ import annotations

import functools
import gc
import logging
import random
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, cnn_net, dataset_for, linear_net, loader
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

from lightning_vram import VramMonitorWarning
from lightning_vram.prediction.containment import reach
from lightning_vram.prediction.replay._fake import FakeTensor


def cnn_loader() -> DataLoader[Any]:
    return loader(dataset_for("cnn"), batch_size=8)


def simulated(monitor: Any) -> bool:
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
    return True


@pytest.mark.parametrize("path", PATHS)
def test_a_forward_hook_that_keeps_outputs_in_a_list_of_the_users(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        kept: list[torch.Tensor] = []
        module = Classifier(cnn_net())
        module.network[0].register_forward_hook(lambda _m, _i, output: kept.append(output.detach()))
        return Case(module, cnn_loader(), observe=lambda: (len(kept), [type(t) for t in kept], torch.stack(kept)))

    monitor = assert_untouched(build, tmp_path, path)
    assert simulated(monitor)


@pytest.mark.parametrize("path", PATHS)
def test_generators_held_outside_the_module_do_not_advance(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        numpy_rng = np.random.default_rng(1)
        python_rng = random.Random(2)
        torch_rng = torch.Generator().manual_seed(3)

        class Noisy(Classifier):
            def __init__(self) -> None:
                super().__init__(cnn_net())
                self.own_rng = np.random.default_rng(4)  # held by the module: the replay's copy draws from a copy

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                inputs, targets = batch
                scale = float(numpy_rng.random()) + python_rng.random() + float(self.own_rng.random())
                noise = torch.rand(inputs.shape, generator=torch_rng)
                return nn.functional.cross_entropy(self(inputs + scale * noise), targets)

        module = Noisy()

        def observe() -> Any:
            states = (numpy_rng.bit_generator.state, python_rng.getstate(), torch_rng.get_state())
            return (*states, module.own_rng.bit_generator.state)

        return Case(module, cnn_loader(), observe=observe)

    assert_untouched(build, tmp_path, path)


NUMPY_RANDOM: dict[str, Any] = {}


def child_generator(kind: str) -> np.random.Generator:
    """A step's own stream, spawned from (or drawing on) the global NumPy object of ``kind``.

    ``spawn`` advances a count kept in the parent's ``SeedSequence`` (``n_children_spawned``, read-only in Python).
    """
    parent = NUMPY_RANDOM[kind]
    if kind == "Generator":
        return parent.spawn(1)[0]
    if kind == "SeedSequence":
        return np.random.default_rng(parent.spawn(1)[0])
    if kind == "PCG64DXSM":
        return np.random.Generator(parent.spawn(1)[0])
    return np.random.Generator(parent)  # a bare bit generator, wrapped anew each step


class SpawnsNumpyStreams(Classifier):
    def __init__(self, kind: str) -> None:
        super().__init__(cnn_net())
        self.kind = kind

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        noise = child_generator(self.kind).standard_normal(inputs.shape).astype("float32")
        return nn.functional.cross_entropy(self(inputs + 0.1 * torch.from_numpy(noise)), targets)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["Generator", "SeedSequence", "MT19937", "PCG64DXSM"])
def test_numpy_streams_spawned_in_the_step_leave_their_parent_untouched(tmp_path: Path, kind: str, path: str) -> None:
    def build() -> Case:
        seeds = np.random.SeedSequence(5)
        if kind == "SeedSequence":
            NUMPY_RANDOM[kind] = seeds
        elif kind == "Generator":
            NUMPY_RANDOM[kind] = np.random.Generator(np.random.PCG64(seeds))
        else:
            NUMPY_RANDOM[kind] = getattr(np.random, kind)(seeds)

        def observe() -> Any:
            bits = NUMPY_RANDOM[kind].bit_generator if kind == "Generator" else NUMPY_RANDOM[kind]
            state = None if kind == "SeedSequence" else bits.state
            return state, seeds.n_children_spawned

        return Case(SpawnsNumpyStreams(kind), cnn_loader(), observe=observe)

    monitor = assert_untouched(build, tmp_path, path)
    assert simulated(monitor)


@pytest.mark.parametrize("path", PATHS)
def test_a_seed_sequence_whose_count_cannot_be_read_is_refused(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NumPy whose ``SeedSequence`` pickles in another form: its spawn count could not be put back, so no replay."""
    monkeypatch.setattr(reach, "seed_sequence_state", lambda _value: None)

    def build() -> Case:
        NUMPY_RANDOM["SeedSequence"] = np.random.SeedSequence(5)
        return Case(
            SpawnsNumpyStreams("SeedSequence"),
            cnn_loader(),
            observe=lambda: NUMPY_RANDOM["SeedSequence"].n_children_spawned,
        )

    monitor = assert_untouched(build, tmp_path, path)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None
    assert (
        "NUMPY_RANDOM" in simulation.skipped
        and "a SeedSequence: this NumPy gives no way to set its count" in simulation.skipped
    )


CALLS: dict[str, int] = {"training_step": 0}


class CountedInAGlobal(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        CALLS["training_step"] += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_call_counts_of_training_step_global_hooks_and_optimizer_hooks(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        CALLS["training_step"] = 0
        calls = {"module hook": 0, "optimizer hook": 0, "nonlocal": 0}
        counted = 0

        def module_hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            calls["module hook"] += 1

        def optimizer_hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            nonlocal counted
            calls["optimizer hook"] += 1
            counted += 1

        handles = [
            nn.modules.module.register_module_forward_hook(module_hook),
            register_optimizer_step_post_hook(optimizer_hook),
        ]

        def observe() -> Any:
            for handle in handles:
                handle.remove()
            return dict(calls), counted, CALLS["training_step"]

        return Case(CountedInAGlobal(cnn_net()), cnn_loader(), observe=observe)

    assert_untouched(build, tmp_path, path, steps=6)
    assert CALLS["training_step"] == 6


@functools.lru_cache(maxsize=8)
def causal_mask(size: int) -> torch.Tensor:
    """A cached helper, as transformer code caches causal masks and rotary tables."""
    return torch.ones(size, size).tril()


class UsesACachedMask(Classifier):
    def __init__(self) -> None:
        super().__init__(linear_net())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        mixed = causal_mask(inputs.shape[0]) @ inputs / inputs.shape[0]
        return nn.functional.cross_entropy(self(mixed), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_cache_filled_first_by_the_replay_holds_no_fake_tensor(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        causal_mask.cache_clear()
        observe = lambda: [type(causal_mask(8)), causal_mask.cache_info().currsize]  # noqa: E731
        return Case(UsesACachedMask(), loader(dataset_for("linear"), batch_size=8), observe=observe)

    monitor = assert_untouched(build, tmp_path, path)
    assert simulated(monitor)
    assert not isinstance(causal_mask(8), FakeTensor)


@dataclass
class Batch:
    """A batch as a plain object; the step adds to it."""

    inputs: torch.Tensor
    targets: torch.Tensor


class PlainBatch:
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets


def plain_objects(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> PlainBatch:
    inputs, targets = zip(*samples, strict=True)
    return PlainBatch(torch.stack(inputs), torch.stack(targets))


class WritesOnItsBatch(Classifier):
    def __init__(self, seen: list[Any]) -> None:
        super().__init__(cnn_net())
        self.seen = seen

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        batch.logits = self(batch.inputs)
        self.seen.append(batch)
        return nn.functional.cross_entropy(batch.logits, batch.targets)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch


@pytest.mark.parametrize("path", PATHS)
def test_a_plain_object_batch_gets_no_fake_tensor(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        seen: list[Any] = []
        data = DataLoader(dataset_for("cnn"), batch_size=8, collate_fn=plain_objects)

        def observe() -> Any:
            return [(type(batch.logits), batch.logits, sorted(vars(batch))) for batch in seen]

        return Case(WritesOnItsBatch(seen), data, observe=observe)

    assert_untouched(build, tmp_path, path)


COUNTER = torch.zeros(())


class CountsInAGlobalTensor(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        COUNTER.add_(1)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_a_one_element_tensor_outside_the_module_keeps_its_value(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        COUNTER.zero_()
        return Case(CountsInAGlobalTensor(cnn_net()), cnn_loader(), observe=lambda: COUNTER.clone())

    assert_untouched(build, tmp_path, path)
    assert COUNTER.item() == 4


class HoldsATable(Classifier):
    """A module with a large NumPy array (a lookup table): the replay shares it, read-only, rather than copy it."""

    def __init__(self, rows: int) -> None:
        super().__init__(cnn_net())
        self.table = np.zeros((rows, 1024), dtype=np.float32)
        self.writes = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.writes:
            self.table[batch_idx] += 1.0
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("writes", [False, True])
def test_a_numpy_table_is_shared_read_only_and_never_written_by_the_replay(tmp_path: Path, writes: bool) -> None:
    def build() -> Case:
        module = HoldsATable(rows=4096)  # 16 MiB
        module.writes = writes
        return Case(module, cnn_loader(), observe=lambda: (module.table.sum(), module.table.flags.writeable))

    monitor = assert_untouched(build, tmp_path, "cpu")
    simulation = monitor.session.simulation
    assert simulation is not None
    if writes:  # writing into a shared array is refused inside the replay: the replay is skipped, not the write
        assert simulation.skipped is not None and "read-only" in simulation.skipped
    else:
        assert simulation.baseline is not None


class GradientPenalty(Classifier):
    """A training step that differentiates its own loss with ``torch.func.grad`` (a gradient penalty)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, _targets = batch
        loss = super().training_step(batch, batch_idx)
        penalty = torch.func.grad(lambda x: (x**2).sum())(inputs.detach())
        return loss + 1e-3 * penalty.mean()


class DisablesSavedTensorHooks(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.autograd.graph.disable_saved_tensors_hooks("this step keeps no hooks"):
            return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("module_class", [GradientPenalty, DisablesSavedTensorHooks])
@pytest.mark.parametrize("path", PATHS)
def test_steps_that_refuse_saved_tensor_hooks_train_and_the_report_says_what_stood_aside(
    tmp_path: Path, path: str, module_class: type[Classifier]
) -> None:
    monitor = assert_untouched(lambda: Case(module_class(cnn_net()), cnn_loader()), tmp_path, path)
    assert monitor.report is not None
    reasons = [entry.reason for entry in monitor.report.not_measured]
    assert any("saved-tensor hooks" in reason and "were not counted tensor by tensor" in reason for reason in reasons)
    assert not any("no training batch reached" in reason for reason in reasons)  # four did: the hooks stood aside


class LeaksIntoALibraryObject(Classifier):
    """Stores its logits on an object of a library's (stdlib logging here), which the replay's walk does not enter."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        logging.getLogger("hostile.leak").last_logits = logits.detach()
        return nn.functional.cross_entropy(logits, targets)


def test_a_fake_tensor_left_where_the_replay_cannot_reach_turns_replays_off_with_one_warning(tmp_path: Path) -> None:
    logger = logging.getLogger("hostile.leak")

    def build() -> Case:
        logger.__dict__.pop("last_logits", None)
        return Case(LeaksIntoALibraryObject(cnn_net()), cnn_loader(), observe=lambda: logger.last_logits)

    with pytest.warns(VramMonitorWarning, match="step replay failed with ReplayEscapeError") as caught:
        monitor = assert_untouched(build, tmp_path, "cpu", steps=6)
    assert len([w for w in caught if "step replay" in str(w.message)]) == 1
    assert type(logger.last_logits) is torch.Tensor
    assert monitor.report is not None
    assert any(entry.what == "step replay" for entry in monitor.report.not_measured)


def test_other_threads_keep_printing_while_a_replay_runs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The events sit on a stdlib object, which the replay's walk does not enter: what the replay sets stays set.
    channel = logging.getLogger("hostile.threads")
    asked, answered = channel.asked, channel.answered = threading.Event(), threading.Event()  # type: ignore[attr-defined]

    def other_thread() -> None:
        while asked.wait(10):
            asked.clear()
            print("another thread, during the replay", flush=True)
            answered.set()

    class PrintsDuringTheStep(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            print(f"step {batch_idx}", flush=True)
            events = logging.getLogger("hostile.threads")
            if isinstance(batch[0], FakeTensor) and not events.answered.is_set():  # type: ignore[attr-defined]
                events.asked.set()  # type: ignore[attr-defined]  # the replay runs this copy of the step
                events.answered.wait(10)  # type: ignore[attr-defined]
            return super().training_step(batch, batch_idx)

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    monitor = assert_untouched(lambda: Case(PrintsDuringTheStep(cnn_net()), cnn_loader()), tmp_path, "cpu")
    assert simulated(monitor)
    output = capfd.readouterr().out
    assert output.count("step 0") == 2 and output.count("step 3") == 2  # bare and watched runs: never the replay's
    assert "another thread, during the replay" in output


class SkipsABatch(Classifier):
    """Returns ``None`` on one step (Lightning then skips backward): that step's graph must be freed all the same."""

    def __init__(self, activations: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__(cnn_net())
        self.activations = activations

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        inputs, targets = batch
        hidden = self.network[:3](inputs)
        self.activations.append(weakref.ref(hidden))
        if batch_idx == 1:  # the first sampled step
            return None
        return nn.functional.cross_entropy(self.network[3:](hidden), targets)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`:UserWarning")
@pytest.mark.parametrize("path", PATHS)
def test_a_step_whose_backward_never_runs_frees_its_graph(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        activations: list[weakref.ref[torch.Tensor]] = []

        def observe() -> Any:
            gc.collect()
            return [reference() is None for reference in activations]

        return Case(SkipsABatch(activations), cnn_loader(), observe=observe)

    assert_untouched(build, tmp_path, path)


class Touchy:
    """An object whose dunder methods count every call (the walk and the containment must run none of them)."""

    calls: dict[str, int] = {"getattr": 0, "iter": 0, "repr": 0}  # noqa: RUF012 -- the test's own tally

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1

    def __getattr__(self, name: str) -> Any:
        Touchy.calls["getattr"] += 1
        raise AttributeError(name)

    def __repr__(self) -> str:
        Touchy.calls["repr"] += 1
        return "Touchy()"

    def __hash__(self) -> int:
        return 1


class CountingList(list[int]):
    def __iter__(self) -> Any:
        Touchy.calls["iter"] += 1
        return super().__iter__()


TOUCHY = {Touchy(): CountingList([1, 2])}


class ReadsTouchyObjects(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert len(TOUCHY) == 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("path", PATHS)
def test_the_walk_and_the_restore_run_none_of_the_users_methods(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        Touchy.calls.update(dict.fromkeys(Touchy.calls, 0))
        return Case(ReadsTouchyObjects(cnn_net()), cnn_loader(), observe=lambda: dict(Touchy.calls))

    monitor = assert_untouched(build, tmp_path, path)
    assert simulated(monitor)
