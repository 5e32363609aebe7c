"""The replay's copy of a module: parameters faked directly are the ones ``deepcopy`` under the fake copy mode makes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from replay_models import ARCHITECTURES
from torch import nn

from lightning_vram.prediction.replay import twin
from lightning_vram.prediction.replay._fake import FakeTensorMode


def _described(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        type(tensor),
        isinstance(tensor, nn.Parameter),
        getattr(tensor, "_is_param", None),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
        tensor.is_leaf,
        tensor.grad_fn,
        tensor.untyped_storage().nbytes(),
    )


def _copies(module: nn.Module, monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, nn.Module]:
    """The module's fake copy as the replay makes it, and as ``deepcopy`` alone makes it."""
    direct, _ = twin.fake_module(module, FakeTensorMode(allow_non_fake_inputs=True), {})
    with monkeypatch.context() as patched:
        patched.setattr(twin, "_fake_parameters", lambda *_arguments: None)
        deep, _ = twin.fake_module(module, FakeTensorMode(allow_non_fake_inputs=True), {})
    return direct, deep


@pytest.mark.parametrize("name", ["resnet", "encoder", "lstm", "gpt2"])
def test_each_parameter_is_the_one_deepcopy_makes_with_a_storage_of_its_own(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = ARCHITECTURES[name].build()
    module.get_parameter(next(iter(dict(module.named_parameters())))).requires_grad_(False)  # a frozen one too
    memo: dict[int, Any] = {}
    twin._fake_parameters(module, FakeTensorMode(allow_non_fake_inputs=True), memo)
    assert set(memo) == {id(parameter) for parameter in module.parameters()}  # every one faked directly
    direct, deep = _copies(module, monkeypatch)
    named = [(name, _described(tensor)) for name, tensor in (*direct.named_parameters(), *direct.named_buffers())]
    assert named == [(name, _described(tensor)) for name, tensor in (*deep.named_parameters(), *deep.named_buffers())]
    storages = [tensor.untyped_storage()._cdata for tensor in direct.parameters()]
    assert len(set(storages)) == len(storages)
    real = {tensor.untyped_storage()._cdata for tensor in module.parameters()}
    assert not real & set(storages)


def test_parameters_sharing_a_storage_get_one_each_and_a_subclass_or_a_strided_one_is_left_to_deepcopy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Scaled(nn.Parameter):
        """A parameter subclass (as quantization libraries make): its own ``__deepcopy__`` may matter."""

    module = nn.Module()
    base = torch.arange(8.0)
    module.whole = nn.Parameter(base)
    module.viewed = nn.Parameter(base.view(2, 4))  # the same storage, as deepcopy's clones do not share it
    module.scaled = Scaled(torch.ones(3))
    module.transposed = nn.Parameter(torch.ones(3, 5).t())  # not contiguous: clone keeps its strides
    module.plain = nn.Parameter(torch.ones(5))
    faked: list[str] = []
    original = twin._fake_parameters

    def recording(real: nn.Module, mode: FakeTensorMode, memo: dict[int, Any]) -> None:
        before = set(memo)
        original(real, mode, memo)
        faked.extend(name for name, tensor in real.named_parameters() if id(tensor) in set(memo) - before)

    monkeypatch.setattr(twin, "_fake_parameters", recording)
    copied, _ = twin.fake_module(module, FakeTensorMode(allow_non_fake_inputs=True), {})
    assert faked == ["whole", "viewed", "plain"]
    assert type(copied.scaled).__name__ == "FakeTensor" and isinstance(copied.scaled, nn.Parameter)
    assert copied.transposed.stride() == (1, 5)
    assert copied.whole.untyped_storage()._cdata != copied.viewed.untyped_storage()._cdata  # as deepcopy clones them
