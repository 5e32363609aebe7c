"""One block held at every place of a layer list (``nn.ModuleList([block] * 6)``, or an ``nn.Sequential`` of it) is
checkpointed at each place.

``named_modules()`` names such a block once (``layers.0``), called six times for one call of its caller, and its
list holds nothing else. Before, a container of one child was never planned, so the run's advice was none
("checkpoint network.layers.0.norm ... saves 80.0 KiB (0.2% of the measured peak)"), while one wrapper at every place
of the list realises what the same block shared by attribute does (22.6 MiB of a 32.7 MiB peak) and trains the same.
The printed code puts one wrapper wherever the list holds the block: ``layers[0] = Checkpointed(layers[0])`` alone
would checkpoint one call of six.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpointing_shared_block import (
    Block,
    Classifier,
    advised,
    applied,
    assert_applied_saves_and_trains_the_same,
)
from torch import nn

pytestmark = pytest.mark.replay  # the advice and its saving come from the replay


class AliasedLayers(nn.Module):
    """One block at every place of a layer list (run by a loop, or an ``nn.Sequential``): six layers, one block."""

    def __init__(self, sequential: bool, width: int = 64, layers: int = 6) -> None:
        super().__init__()
        self.inputs = nn.Linear(32, width)
        block = Block(width)
        self.layers = nn.Sequential(*[block] * layers) if sequential else nn.ModuleList([block] * layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inputs(x)
        if isinstance(self.layers, nn.Sequential):
            h = self.layers(h)
        else:
            for layer in self.layers:
                h = layer(h)
        return self.head(h.mean(1))


class AliasedList(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.network = AliasedLayers(sequential=False)


class AliasedSequential(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.network = AliasedLayers(sequential=True)


@pytest.mark.parametrize("kind", [AliasedList, AliasedSequential], ids=["ModuleList", "Sequential"])
def test_a_block_at_every_place_of_a_list_is_checkpointed_at_each_and_trains_the_same(
    tmp_path: Path, kind: type[Classifier]
) -> None:
    report, advice = advised(tmp_path / "before", kind)  # before: none, `layers.0.norm` saved 0.2%
    assert "`network.layers.0` at every place of the model holding it" in advice.title
    assert "if module is block:" in advice.detail
    module = applied(advice, kind)
    wrappers = {id(layer) for layer in module.network.layers}
    assert len(wrappers) == 1 and type(module.network.layers[0]).__name__ == "Checkpointed"  # one wrapper, six places
    # seen: 23,674,880 B realised, as simulated
    assert_applied_saves_and_trains_the_same(tmp_path, report, advice, kind, module)


class TwoListsOneBlock(nn.Module):
    """One block held by an encoder's list and a decoder's (three places each): ``named_modules()`` names it once."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inputs = nn.Linear(32, width)
        block = Block(width)
        self.encoder = nn.ModuleList([block] * 3)
        self.decoder = nn.ModuleList([block] * 3)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inputs(x)
        for layer in [*self.encoder, *self.decoder]:
            h = layer(h)
        return self.head(h.mean(1))


class TwoLists(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.network = TwoListsOneBlock()


def test_a_block_two_lists_share_is_checkpointed_in_both_and_trains_the_same(tmp_path: Path) -> None:
    # Wrapped in its first list alone, the block ran 3 of its 6 calls checkpointed: the replay discarded the plan
    # ("its caller calls `network.encoder.0` 3 time(s) with the plan, 6 time(s) without") and nothing was advised
    # ("checkpoint network.encoder.0.norm ... saves 80.0 KiB (0.2% of the measured peak)").
    report, advice = advised(tmp_path / "before", TwoLists)  # before: none
    assert "`network.encoder.0` at every place of the model holding it" in advice.title
    module = applied(advice, TwoLists)
    assert len({id(layer) for layer in [*module.network.encoder, *module.network.decoder]}) == 1  # one wrapper
    # seen: 23,674,880 B realised, as replayed
    assert_applied_saves_and_trains_the_same(tmp_path, report, advice, TwoLists, module)


class DecoderLayer(nn.Module):
    """A decoder layer of its own block, then the encoder's last block (held again here): the block shared inside."""

    def __init__(self, shared: Block, width: int) -> None:
        super().__init__()
        self.mlp = Block(width)
        self.inner = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.mlp(x))


class BlockInsideAnotherUnit(TwoListsOneBlock):
    """An encoder's list whose last block a decoder's first layer holds too: one of its places inside another unit."""

    def __init__(self, width: int = 64) -> None:
        super().__init__(width)
        shared = Block(width)
        self.encoder = nn.ModuleList([Block(width), Block(width), shared])
        self.decoder = nn.ModuleList([DecoderLayer(shared, width), Block(width), Block(width)])


class SharedInside(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.network = BlockInsideAnotherUnit()


def test_a_shared_block_s_place_inside_another_unit_is_left_to_that_unit(tmp_path: Path) -> None:
    # Before: the printed loop also wrapped the block at `network.decoder.0.inner`, inside `Checkpointed(decoder.0)`:
    # a checkpoint nested in another, the block recomputed twice in backward (wrapped: encoder.0-2, decoder.0,
    # decoder.0.block.inner, decoder.1-2), which the replay did as printed.
    report, advice = advised(tmp_path / "before", SharedInside)
    assert "`network.encoder.0-2` and `network.decoder.0-2` (6 units)" in advice.title
    module = applied(advice, SharedInside)
    wrapped = [name for name, child in module.named_modules() if type(child).__name__ == "Checkpointed"]
    assert wrapped == [*(f"network.encoder.{index}" for index in range(3)), *(f"network.decoder.{i}" for i in range(3))]
    assert type(module.network.decoder[0].block.inner).__name__ == "Block"  # recomputed with its layer, once
    assert_applied_saves_and_trains_the_same(tmp_path, report, advice, SharedInside, module)
