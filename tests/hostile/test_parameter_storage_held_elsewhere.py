"""A parameter whose storage something else holds too: the replay predicts what it predicted before parameters were
faked directly (``twin._fake_parameters``), and a lazy module's uninitialised parameter does not stop the copy.

The fake converter gives every tensor of one real storage a view of one fake storage. The first direct fakes were the
converter's fake of the parameter's storage itself, where ``deepcopy`` gives the parameter a clone: a plain attribute
holding the parameter's data (``self.handle = weight.data``, as a weight clipper keeps), or the tensor a parameter is
a view of, then shared the parameter's fake storage, and the replay counted the step's writes through it
differently: both cases' peaks were 325,872, 317,688 and 440,560 bytes (forward, backward, optimizer) faked so,
383,544, 383,224 and 506,096 through ``deepcopy`` (its clone of the weight, 64 KiB, apart from the handle's storage).
A shortcut must not change what the replay predicts: a direct fake is now a new fake tensor (``empty_strided``),
which the converter never ties to the real storage (found by the attack on the change, eleventh session).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier
from torch import nn

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay import twin
from lightning_vram.prediction.replay._fake import FakeTensorMode
from lightning_vram.records import Phase, ReplayedStep


def _network() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


class ClippedThroughAHandle(Classifier):
    """Clips its first layer's weight in the step, through a handle on its data kept at construction."""

    def __init__(self) -> None:
        super().__init__(_network(), OPTIMIZERS["adam"])
        self.handle = self.network[0].weight.data

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.handle.clamp_(-0.1, 0.1)
        return loss


class ViewOfAFlatTensor(Classifier):
    """Its first layer's weight is a view of a flat tensor it keeps (not a buffer), which the step writes."""

    def __init__(self) -> None:
        super().__init__(_network(), OPTIMIZERS["adam"])
        self.flat = torch.zeros(256 * 64)
        self.network[0].weight = nn.Parameter(self.flat.view(256, 64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.flat.mul_(0.5)
        return loss


def _figures(module: Classifier, batch: Any) -> tuple[Any, ...]:
    """The replayed step's phases and allocation sequence (sizes and streams; ids are the run's)."""
    predictor = Predictor(module, None, batch, warm_up=True, allocator=AllocatorSettings())
    with round_of_replays():
        step = predictor.replay()
    assert isinstance(step, ReplayedStep) and step.allocations is not None, step
    events = [event if isinstance(event, Phase) else (event[0], event[2], event[3]) for event in step.allocations]
    return step.phases, step.modules, events


@pytest.mark.parametrize("kind", [ClippedThroughAHandle, ViewOfAFlatTensor])
def test_a_parameter_whose_storage_is_held_elsewhere_replays_as_deepcopy_copies_it(
    kind: type[Classifier], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    torch.manual_seed(0)
    direct = _figures(kind(), batch)
    monkeypatch.setattr(twin, "_fake_parameters", lambda *_arguments: None)  # every parameter through deepcopy
    torch.manual_seed(0)
    assert direct == _figures(kind(), batch)


def test_a_module_with_an_uninitialised_parameter_is_copied() -> None:
    module = nn.Module()
    module.head = nn.LazyLinear(3)  # before its first forward
    module.body = nn.Linear(4, 4)
    copied, _ = twin.fake_module(module, FakeTensorMode(allow_non_fake_inputs=True), {})
    assert isinstance(copied.head.weight, nn.parameter.UninitializedParameter)
    assert isinstance(copied.body.weight, nn.Parameter) and copied.body.weight.shape == (4, 4)
    memo: dict[int, Any] = {}
    twin._fake_parameters(module, FakeTensorMode(allow_non_fake_inputs=True), memo)
    assert set(memo) == {id(module.body.weight), id(module.body.bias)}  # the plain ones still faked directly
