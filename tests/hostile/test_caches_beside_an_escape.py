"""The user's ``lru_cache`` functions when a replay's fake tensor escaped into one of them: only the caches that hold
one are cleared.

Clearing a cache is not invisible: its function runs again (drawing from the global generator, here), its results
are new objects, its ``cache_info`` changes. The check walks each cache's entries to find the escaped tensors; a
cache whose walk met more than its limit of objects (100,000) was taken to hold one and cleared, so a cache of 120,000
strings or records, filled before the round and untouched by it, was cleared beside the one that held the tensor. The
walk counts only what the collector tracks (a string cannot hold a tensor): a cache holding the escaped tensor beside
120,000 strings is still found, and cleared. Nor does the walk run the user's code: it asked each object its
``__class__`` (``isinstance``), which a lazy proxy answers by resolving itself (here it raises, and the check with it).
A cache whose entry holds the other cache (a tokenizer keeping a cached helper) was cleared too where the walk reached
it first: clearing it lets go of nothing the other cache holds. A fake tensor held by a real one (in its attributes,
as a tensor subclass holds its inner tensors) was not found, the walk stopping at tensors: the check raised where the
code before it cleared the cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_vram.prediction.containment.escapes import _holds, register, round_of_replays
from lightning_vram.prediction.replay._fake import FakeTensorMode

_MODES: list[FakeTensorMode] = []
"""The mode of the replay running now (none outside one)."""
ENTRIES = 120_000
ASKED: list[str] = []
"""What the user's lazy proxy was asked."""


@dataclass
class Nested:
    """A result of the user's that holds its tensor deep down, in a cycle."""

    parts: dict[str, list[Any]] = field(default_factory=dict)
    me: Any = None


class Tokenizer:
    """An object of the user's that keeps a cached helper (the cache that holds the escaped tensor)."""

    def __init__(self) -> None:
        self.helper = _filled


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    """Filled before the round, listed before ``_filled``: its entry reaches the other cache, not its entries."""
    return Tokenizer()


@functools.lru_cache(maxsize=8)
def _filled(size: int) -> Nested:
    """A cache the replay fills: a fake tensor, nested beside a table of strings, while a replay runs."""
    with _MODES[0] if _MODES else torch.device("cpu"):
        tensor = torch.empty(size)
    nested = Nested({"table": [f"token{index}" for index in range(ENTRIES)], "deep": [[(tensor,)]]})
    nested.me = nested
    return nested


@functools.cache
def _vocabulary() -> tuple[dict[str, int], torch.Tensor]:
    """Filled before the round: a table of strings, and a random embedding drawn from the global generator."""
    return {f"token{index}": index for index in range(ENTRIES)}, torch.randn(4)


class LazyProxy:
    """Stands for an object made on first use (as ``lazy_object_proxy`` or werkzeug's ``LocalProxy`` do): asking its
    ``__class__`` resolves it, here outside the context it needs."""

    @property  # type: ignore[misc]  # a proxy's __class__ is its target's
    def __class__(self) -> type:
        ASKED.append("__class__")
        raise RuntimeError("working outside of the request context")


@functools.cache
def _proxies() -> list[LazyProxy]:
    """Filled before the round: an object of the user's that must not be asked its class."""
    return [LazyProxy()]


@functools.cache
def _records() -> tuple[list[list[int]], torch.Tensor]:
    """Filled before the round: many small records, and a random tensor drawn from the global generator."""
    return [[index] for index in range(ENTRIES)], torch.randn(4)


def test_only_the_cache_holding_the_escaped_tensor_is_cleared() -> None:
    for cache in (_filled, _vocabulary, _records, _proxies, _tokenizer):
        cache.cache_clear()
    torch.manual_seed(0)
    vocabulary, records, proxies, tokenizer = _vocabulary(), _records(), _proxies(), _tokenizer("gpt2")
    generator = torch.get_rng_state()
    with round_of_replays():
        mode = FakeTensorMode()
        register(mode)
        _MODES.append(mode)
        try:
            _filled(4)
        finally:
            _MODES.clear()
    assert _filled.cache_info().currsize == 0  # the escape, cleared: no error raised
    assert _vocabulary.cache_info().currsize == 1 and _vocabulary() is vocabulary
    assert _records.cache_info().currsize == 1 and _records() is records
    assert torch.equal(torch.get_rng_state(), generator)  # neither function ran again
    assert _proxies() is proxies and ASKED == []
    assert _tokenizer("gpt2") is tokenizer


def test_a_cache_reaching_another_cache_does_not_hold_that_one_s_entries() -> None:
    _filled.cache_clear()
    _tokenizer.cache_clear()
    _tokenizer("gpt2")
    mode = FakeTensorMode()
    _MODES.append(mode)
    try:
        nested = _filled(4)
    finally:
        _MODES.clear()
    tensor = nested.parts["deep"][0][0][0]
    assert _holds(_filled, {id(tensor)}) and not _holds(_tokenizer, {id(tensor)})  # in whichever order they are met
    _filled.cache_clear()


@functools.lru_cache(maxsize=8)
def _padding_mask(size: int) -> torch.Tensor:
    """A cache the replay fills with a tensor holding a fake tensor in its attributes, as a tensor subclass holds its
    inner tensors (``torch.masked.MaskedTensor``): the outer tensor is not a fake one."""
    mask = torch.ones(size, dtype=torch.bool)
    with _MODES[0]:
        mask.lengths = torch.empty(size)  # type: ignore[attr-defined]
    return mask


def test_a_cache_holding_a_fake_tensor_inside_a_real_one_is_cleared() -> None:
    _padding_mask.cache_clear()
    with round_of_replays():
        mode = FakeTensorMode()
        register(mode)
        _MODES.append(mode)
        try:
            _padding_mask(4)
        finally:
            _MODES.clear()
    assert _padding_mask.cache_info().currsize == 0  # cleared: no error raised
