"""The check after a round of replays: what it freezes while the round runs, and what it still finds."""

from __future__ import annotations

import functools
import gc
from typing import Any

import pytest
import torch

from lightning_vram.prediction.containment.escapes import ReplayEscapeError, register, round_of_replays
from lightning_vram.prediction.replay._fake import FakeTensor, FakeTensorMode


def _fake(mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        return torch.empty(4)


def test_a_round_freezes_what_was_alive_before_it_and_unfreezes_it_as_it_ends() -> None:
    before = object()
    with round_of_replays():
        assert gc.get_freeze_count() > 0
        assert not any(item is before for item in gc.get_objects())  # frozen: out of the collector's view
        mode = FakeTensorMode()
        register(mode)
        _fake(mode)
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyError), round_of_replays():
        raise KeyError("the body failed")
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_them_frozen() -> None:
    # The process's own frozen objects stay frozen (out of the collector's view) and the round freezes nothing more.
    # Not the count to the object: a frozen object whose last reference goes (another thread's) leaves the count.
    mine = [object()]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with round_of_replays():
            mode = FakeTensorMode()
            register(mode)
            _fake(mode)
        assert gc.get_freeze_count() <= frozen
        assert not any(item is mine for item in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(item is mine for item in gc.get_objects())


def test_a_fake_tensor_stored_in_an_object_older_than_the_round_is_found() -> None:
    held: list[Any] = []

    def replay_that_keeps_its_tensor() -> None:
        with round_of_replays():
            mode = FakeTensorMode()
            register(mode)
            held.append(_fake(mode))

    with pytest.raises(ReplayEscapeError, match="1 fake tensor"):
        replay_that_keeps_its_tensor()
    assert gc.get_freeze_count() == 0 and isinstance(held[0], FakeTensor)


def test_a_fake_tensor_held_by_an_old_object_that_became_garbage_is_not_an_escape() -> None:
    # A cycle made before the round, let go during it while it holds a fake tensor: garbage, collected by the check's
    # second look (with every object in view), not reported as held.
    old: dict[str, Any] = {}
    old["self"] = old
    with round_of_replays():
        mode = FakeTensorMode()
        register(mode)
        old["tensor"] = _fake(mode)
        del old
    assert gc.get_freeze_count() == 0


_MODES: list[FakeTensorMode] = []
"""The mode :func:`_cached` makes its tensor in, while a test's replay runs (a real tensor elsewhere)."""


@functools.lru_cache(maxsize=4)
def _cached(size: int) -> torch.Tensor:
    """A cache of the user's (this file is the user's code) that a replay fills with a fake tensor."""
    return _fake(_MODES[0]) if _MODES else torch.zeros(size)


@functools.lru_cache(maxsize=4)
def _untouched(size: int) -> torch.Tensor:
    """A cache of the user's that the replay does not fill."""
    return torch.zeros(size)


def test_a_user_cache_that_grew_with_a_fake_tensor_is_cleared_and_one_that_did_not_is_kept() -> None:
    _cached.cache_clear()
    _untouched.cache_clear()
    kept = _untouched(4)
    with round_of_replays():
        mode = FakeTensorMode()
        register(mode)
        _MODES.append(mode)
        try:
            _cached(4)
        finally:
            _MODES.clear()
    assert _cached.cache_info().currsize == 0  # cleared by the check: no error raised
    assert _untouched.cache_info().currsize == 1 and _untouched(4) is kept


@functools.lru_cache(maxsize=1)
def _full(size: int) -> torch.Tensor:
    """A cache of the user's that is full before the round: the replay's entry takes the place of the old one."""
    return _fake(_MODES[0]) if _MODES else torch.zeros(size)


@functools.cache
def _keyed(tensor: torch.Tensor) -> int:
    """A cache of the user's whose key is the tensor it is called with (a fake one in the replay)."""
    return tensor.dim()


def test_a_full_cache_whose_entry_the_replay_replaced_and_a_cache_keyed_by_a_fake_tensor_are_cleared() -> None:
    # The first holds as many entries after the round as before it (no growth to see); the second holds its fake
    # tensor as an argument, not in a result.
    _full.cache_clear()
    _keyed.cache_clear()
    _full(4)
    kept = _untouched(8)
    with round_of_replays():
        mode = FakeTensorMode()
        register(mode)
        _MODES.append(mode)
        try:
            _full(8)
            _keyed(_fake(mode))
        finally:
            _MODES.clear()
    assert _full.cache_info().currsize == 0 and _keyed.cache_info().currsize == 0
    assert _untouched(8) is kept


def test_a_fake_tensor_held_by_a_cache_and_by_a_list_of_the_user_s_is_still_an_escape() -> None:
    # Clearing the cache lets go of the cache's reference only: the list still holds the tensor.
    _keyed.cache_clear()
    held: list[torch.Tensor] = []

    def replay_that_keeps_its_tensor_twice() -> None:
        with round_of_replays():
            mode = FakeTensorMode()
            register(mode)
            held.append(_fake(mode))
            _keyed(held[0])

    with pytest.raises(ReplayEscapeError, match="1 fake tensor"):
        replay_that_keeps_its_tensor_twice()
    assert _keyed.cache_info().currsize == 0 and isinstance(held[0], FakeTensor)
