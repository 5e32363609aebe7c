"""No collective runs inside a replay: a rank's replay talks to no other rank.

Under a multi-process strategy every rank replays its own sampled step, at the end of that step, and may skip a
replay another rank runs (its budget ran out, its batch was not the largest). A collective inside one rank's replay
(a ``torch.distributed`` call in the user's step, ``SyncBatchNorm``, ``self.all_gather``) would wait for ranks that
never join it, or pair with a collective of their training: the replay stops at the first one, before it runs, and
is skipped saying so. ``torch.distributed``'s collectives reach the dispatcher as ``c10d`` ops (the fake tensors'
ones included), where :class:`NoCollectives` sees each before it runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lightning_vram.prediction.replay._fake import TorchDispatchMode

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
"""The dispatcher namespaces of torch's collectives (``c10d.allreduce_``, ``_c10d_functional.all_reduce``...)."""


class CollectiveError(RuntimeError):
    """The replayed step called a collective; it was not run."""


# torch ships TorchDispatchMode without annotations.
class NoCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Raises :class:`CollectiveError` at the first collective op, before it runs.

    Enter it inside the fake mode, so that every op the replayed code runs passes through it.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES:
            raise CollectiveError(
                f"the step runs a collective ({func}): a rank's replay runs none, so that no rank waits at a collective"
                " another rank's replay never reaches"
            )
        return func(*args, **(kwargs or {}))


def without_collectives() -> AbstractContextManager[Any]:
    """:class:`NoCollectives` where a process group is initialized; nothing otherwise (a collective fails there).

    Nothing either where the default group is torch's fake one (a one-process replay of a multi-GPU strategy sets it
    up: :mod:`~lightning_vram.prediction.strategies.fsdp2`): its collectives send nothing and wait for no rank.
    """
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_backend() != "fake":
        return NoCollectives()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
    return nullcontext()
