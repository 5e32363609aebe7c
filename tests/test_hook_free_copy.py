"""``without_user_hooks``: the user's copy hooks never run; everything else copies as ``deepcopy`` copies it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_vram.prediction.replay.hook_free import HookedCopyError, without_user_hooks

CALLS: list[str] = []


class Slotted:
    __slots__ = ("__private", "items", "unset")

    def __setstate__(self, state: Any) -> None:
        CALLS.append("Slotted.__setstate__")


class Table(dict):  # type: ignore[type-arg]
    def __reduce_ex__(self, protocol: Any) -> Any:
        CALLS.append("Table.__reduce_ex__")
        return super().__reduce_ex__(protocol)


class Rows(list):  # type: ignore[type-arg]
    def __getstate__(self) -> Any:
        CALLS.append("Rows.__getstate__")
        return None


class Pair(tuple):  # type: ignore[type-arg]
    def __getstate__(self) -> Any:
        CALLS.append("Pair.__getstate__")
        return None


class Meta(type):
    def __deepcopy__(cls, memo: Any) -> Any:
        CALLS.append("Meta.__deepcopy__")
        return cls


class Classed(metaclass=Meta):
    pass


class Net(nn.Module):
    """A module of the user's whose ``__setstate__`` registers; nn.Module's own state handling is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.rows = Rows([[1.0]])

    def __setstate__(self, state: Any) -> None:
        CALLS.append("Net.__setstate__")
        super().__setstate__(state)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layer(inputs)  # type: ignore[no-any-return]


def test_the_users_hooks_do_not_run_and_the_copy_holds_the_same_contents() -> None:
    CALLS.clear()
    slotted = Slotted()
    slotted.items = [1, 2]
    slotted._Slotted__private = 3  # type: ignore[attr-defined]
    table = Table(a=[1])
    table.note = "kept"
    net = Net()
    original = {"slotted": slotted, "table": table, "net": net, "class": Classed}
    with without_user_hooks():
        copied = copy.deepcopy(original)
    assert CALLS == []
    assert type(copied["slotted"]) is Slotted and copied["slotted"].items == [1, 2]
    assert copied["slotted"].items is not slotted.items and not hasattr(copied["slotted"], "unset")
    assert copied["slotted"]._Slotted__private == 3
    assert type(copied["table"]) is Table and copied["table"] == {"a": [1]} and copied["table"].note == "kept"
    assert copied["table"]["a"] is not table["a"]
    assert copied["class"] is Classed
    copied_net = copied["net"]
    assert type(copied_net) is Net and type(copied_net.rows) is Rows and copied_net.rows == [[1.0]]
    assert copied_net.layer.weight is not net.layer.weight and isinstance(copied_net.layer.weight, nn.Parameter)
    assert torch.equal(copied_net.layer.weight, net.layer.weight)
    assert copied_net(torch.ones(1, 3)).shape == (1, 2)


def test_a_tuple_subclass_with_a_hook_is_refused_naming_it_and_copy_is_as_before_after() -> None:
    CALLS.clear()
    before = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    with without_user_hooks(), pytest.raises(HookedCopyError, match=r"Pair\.__getstate__"):
        copy.deepcopy([Pair((1, 2))])
    assert copy._deepcopy_dispatch is before  # type: ignore[attr-defined]
    copy.deepcopy(Rows([1]))
    assert CALLS == ["Rows.__getstate__"]  # outside, deepcopy runs the hooks as ever
