"""A step that acts on the process beyond its objects: torch's global hooks, files, exit callbacks.

Found by attacking 0.11.0's first cut: a step registering a process-wide hook once (keeping its handle) left torch's
registry broken after a replay (its order list out of step with its keys: training then died with a KeyError),
without the handle each replay added a hook that stayed and changed the weights; a step writing files wrote them
again from the replay (a `torch.save` under fake tensors left a truncated file); `atexit` callbacks piled up.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_hooks
from harness import PATHS, Case, assert_untouched
from models import Classifier, linear_net, loader
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram.prediction.containment.reach import reach_of

HANDLES: list[Any] = []
CALLS = [0]
OUTPUT: Path | None = None


def small_loader() -> Any:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    return loader(data, batch_size=8)


def scale(module: nn.Module, inputs: Any, output: Any) -> Any:
    CALLS[0] += 1
    return output * 1.5 if isinstance(output, torch.Tensor) else output


class RegistersAGlobalHook(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            HANDLES.append(nn.modules.module.register_module_forward_hook(scale))
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_global_hook_registered_in_the_step_stays_the_user_s_alone(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        for handle in HANDLES:
            handle.remove()
        HANDLES.clear()
        CALLS[0] = 0

        def observe() -> Any:
            registry = module_hooks._global_forward_hooks
            return CALLS[0], len(list(registry.values())), list(registry.keys()) == [h.id for h in HANDLES]

        return Case(RegistersAGlobalHook(linear_net()), small_loader(), observe=observe)

    try:
        monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    finally:
        for handle in HANDLES:
            handle.remove()
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped


class WritesFiles(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert OUTPUT is not None
        with open(OUTPUT / "log.txt", "a") as log:
            log.write(f"{batch_idx}\n")
        torch.save(self.network[0].weight.detach(), OUTPUT / f"w{batch_idx}.pt")
        if batch_idx == 0:
            atexit.register(CALLS.append, batch_idx)
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_writing_files_or_registering_exit_callbacks_is_not_replayed(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global OUTPUT
        atexit.unregister(CALLS.append)  # each run starts from the same exit callbacks
        OUTPUT = tmp_path / f"files-{len(list(tmp_path.glob('files-*')))}"
        OUTPUT.mkdir()
        written = OUTPUT

        def observe() -> Any:
            saved = [torch.load(file, weights_only=True) for file in sorted(written.glob("w*.pt"))]
            return (written / "log.txt").read_text(), saved

        return Case(WritesFiles(linear_net()), small_loader(), observe=observe)

    try:
        monitor = assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
    finally:
        atexit.unregister(CALLS.append)
    simulation = monitor.session.simulation
    assert simulation is not None and simulation.skipped is not None
    assert "registers exit callbacks" in simulation.skipped and "a replay would do it again" in simulation.skipped
    assert reach_effects(WritesFiles.training_step) == [
        "WritesFiles.training_step registers exit callbacks (each replay would add one)",
        "WritesFiles.training_step opens files (what it writes would be written again)",
        "WritesFiles.training_step may call torch.save (a file it writes would be written again)",
    ]


def reach_effects(function: Any) -> list[str]:
    """What the walk finds ``function`` doing outside the objects a replay puts back."""
    return reach_of([("step", function)], set()).effects
