"""No collective runs inside a replay: a rank's replay talks to no other rank.

Under a multi-process strategy every rank replays its own sampled step, at the end of that step, and may skip a
replay another rank runs (its budget ran out, its batch was not the largest). A collective inside one rank's replay
(a ``torch.distributed`` call in the user's step, ``SyncBatchNorm``, ``self.all_gather``) would wait for ranks that
never join it, or pair with a collective of their training: the replay stops at the first one, before it runs, and
is skipped saying so. ``torch.distributed``'s collectives reach the dispatcher as ``c10d`` ops (the fake tensors'
ones included), where :class:`NoCollectives` sees each before it runs. A collective of a group of torch's ``fake``
backend runs (an FSDP2 rank's replay shards its copy over such groups, made beside the run's: see
:mod:`~lightning_vram.prediction.strategies.fsdp2`): it sends nothing and waits for no rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NoReturn

import torch

from lightning_vram.prediction.replay._fake import TorchDispatchMode

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
"""The dispatcher namespaces of torch's collectives (``c10d.allreduce_``, ``_c10d_functional.all_reduce``...)."""


WAITS = frozenset({"_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"})
"""The functional collectives' wait (on a tensor, no group): it issues nothing, only waits for a collective the
replay already let through (a fake group's: ``DTensor.full_tensor()`` on a replayed FSDP2 copy's parameter)."""

PROCESS_GROUP = "__torch__.torch.classes.c10d.ProcessGroup"
"""The TorchScript class a ``c10d`` op receives its process group as."""


def on_fake_group(args: tuple[Any, ...]) -> bool:
    """Whether a collective op's process group (an argument, or its name for ``_c10d_functional``) is a fake one."""
    from torch.distributed import distributed_c10d as c10d

    named: dict[str, Any] = {name: group for group, name in c10d._world.pg_names.items()}
    for arg in args:
        group = None
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name() == PROCESS_GROUP:
            group = c10d.ProcessGroup.unbox(arg)
        elif isinstance(arg, str):
            group = named.get(arg)
        if group is not None:
            return bool(c10d.get_backend(group) == "fake")
    return False


class CollectiveError(RuntimeError):
    """The replayed step called a collective; it was not run."""


# torch ships TorchDispatchMode without annotations.
class NoCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Raises :class:`CollectiveError` at the first collective op, before it runs (but on a fake group, or a wait).

    Enter it inside the fake mode, so that every op the replayed code runs passes through it.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (
            getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES
            and func.name() not in WAITS
            and not on_fake_group(args)
        ):
            raise CollectiveError(
                f"the step runs a collective ({func}): a rank's replay runs none, so that no rank waits at a collective"
                " another rank's replay never reaches"
            )
        return func(*args, **(kwargs or {}))


@contextmanager
def no_new_groups() -> Iterator[None]:
    """``torch.distributed.new_group`` (``new_subgroups`` through it) raising :class:`CollectiveError` meanwhile.

    Making a group of the run's ranks waits for each of them (gloo's store barrier) and registers it under the next
    name of ``torch.distributed``'s count: a replay's group would be left behind, the run's later groups' names
    shifted. torch's ``_new_group_with_tag`` (which ``new_group`` calls before naming the group) is swapped for the
    refusal while the replay runs, and put back after.
    """
    from torch.distributed import distributed_c10d as c10d

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise CollectiveError(
            "the step makes a process group (torch.distributed.new_group): a rank's replay makes none, so that no"
            " rank waits for ranks whose replays never make it"
        )

    original = c10d._new_group_with_tag
    c10d._new_group_with_tag = refuse
    try:
        yield
    finally:
        c10d._new_group_with_tag = original


def without_collectives() -> AbstractContextManager[Any]:
    """:class:`NoCollectives` and :func:`no_new_groups` where a process group is initialized; nothing otherwise.

    Nothing either where the default group is torch's fake one (a one-process replay of a multi-GPU strategy sets it
    up: :mod:`~lightning_vram.prediction.strategies.fsdp2`): its collectives send nothing and wait for no rank.
    """
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_backend() != "fake":
        return _refused()
    return nullcontext()


@contextmanager
def _refused() -> Iterator[None]:
    """:func:`no_new_groups` and :class:`NoCollectives`, entered together."""
    with no_new_groups(), NoCollectives():  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        yield
