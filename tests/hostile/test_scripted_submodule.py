"""A ``torch.jit.script`` submodule (issue 25, medium): attribution and the replay carry on around it.

0.11.0 switched per-module attribution off for the whole run at the first sampled step (a scripted module refuses
``register_forward_pre_hook``): no breakdown, no replay, no simulated advice. Now the scripted module is counted as
one unit, the other modules as always, and the replay runs it on fake tensors. Training is the same, exactly.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from models import Classifier, dataset_for, loader
from torch import nn

import lightning_vram.measure.scripted as scripted


def scripted_net() -> nn.Module:
    """cnn_net's layers with BatchNorm and ReLU scripted: its running statistics change in training."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.script; users have it
        block = torch.jit.script(nn.Sequential(nn.BatchNorm2d(8), nn.ReLU()))
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=3, padding=1),
        block,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def build() -> Case:
    module = Classifier(scripted_net())
    return Case(module, loader(dataset_for("cnn"), batch_size=8), observe=lambda: _scripted_state(module))


def _scripted_state(module: Classifier) -> dict[str, Any]:
    return {name: tensor.clone() for name, tensor in module.network[1].state_dict().items()}


@pytest.mark.parametrize("path", PATHS)
def test_a_scripted_submodule_is_one_unit_and_the_step_is_replayed(tmp_path: Path, path: str) -> None:
    monitor = assert_untouched(build, tmp_path, path)
    report = monitor.report
    assert report is not None
    names = {profile.name for profile in report.modules}
    assert {"network.0", "network.1", "network.4"} <= names  # the scripted module, and the modules around it
    assert not any(name.startswith("network.1.") for name in names)  # inside TorchScript no hook runs
    notes = {note.what: note.reason for note in report.not_measured}
    assert "tensor-by-tensor attribution" not in notes
    assert notes["per-module activations inside TorchScript modules"].startswith(
        "network.1 is a torch.jit.script module: Python hooks do not run inside TorchScript, so each is counted as"
        " one unit"
    )
    simulation = report.simulation
    assert simulation is not None and simulation.skipped is None
    assert simulation.baseline is not None
    assert simulation.match is not None and simulation.match.matches
    # No variant fails: checkpointing plans leave the scripted module out (torch's checkpoint fails in TorchScript).
    assert [variant.discarded for variant in simulation.variants] == [None] * len(simulation.variants)
    assert simulation.variants
    scripted_profile = next(profile for profile in report.modules if profile.name == "network.1")
    assert scripted_profile.activation_bytes > 0


@pytest.mark.parametrize("path", PATHS)
def test_a_large_scripted_submodule_is_not_copied_for_a_replay(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the copy limit the step is not replayed, and the report says why; attribution carries on.

    BatchNorm2d(8) holds 4 float32 vectors of 8 and a 64-bit count: 4 * 8 * 4 + 8 = 136 bytes.
    """
    monkeypatch.setattr(scripted, "SCRIPTED_COPY_BYTES", 0)
    monitor = assert_untouched(build, tmp_path, path)
    report = monitor.report
    assert report is not None
    assert report.simulation is not None
    assert report.simulation.skipped == (
        "network.1 is a torch.jit.script module holding 136 B of parameters and buffers: TorchScript copies its"
        " tensors for real, not as fake tensors, and a replay would need that memory again (it copies up to 0 B)"
    )
    assert {"network.0", "network.1", "network.4"} <= {profile.name for profile in report.modules}
