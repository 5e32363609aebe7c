"""A replay's time limit, checked before every op it runs: a replay stops within one op of its deadline."""

from __future__ import annotations

import time
from typing import Any

from lightning_vram.prediction.replay._fake import TorchDispatchMode


class ReplayDeadlineError(RuntimeError):
    """The replay's time budget ran out while it ran."""


_QUERIES = frozenset(
    {"is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "dim", "numel", "detach", "alias"}
)


def _may_raise(func: Any) -> bool:
    """Whether the op computes (an ``aten`` op), rather than answer a metadata query.

    C++ asks for a tensor's device, sizes or strides where it cannot pass an exception on (``prim.device`` from
    ``TensorImpl::device()``): raising there aborts the process ("terminate called after throwing an instance of
    'python_error'"). Only computing ops may raise.
    """
    name = getattr(func, "_opname", "")
    return getattr(func, "namespace", "") == "aten" and not name.startswith("sym_") and name not in _QUERIES


# torch ships TorchDispatchMode without annotations.
class Deadline(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Raises :class:`ReplayDeadlineError` at the first op that starts after ``at`` (``time.perf_counter()``, s), once.

    ``None`` never stops. Enter it inside the fake mode, so that every op the replayed code runs passes through it.
    """

    def __init__(self, at: float | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._at = at

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        at = self._at
        if at is not None and _may_raise(func) and time.perf_counter() > at:
            self._at = None  # once: the ops that run while the error unwinds must not raise again
            raise ReplayDeadlineError(f"the time budget ran out during the replay (at {func})")
        return func(*args, **(kwargs or {}))
