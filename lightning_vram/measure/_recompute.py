"""What a recomputation under non-reentrant activation checkpointing creates during backward.

Non-reentrant ``torch.utils.checkpoint`` saves what its recomputed forward saves through saved-tensor hooks of its
own, which hide those tensors from the monitor's hooks. What the recomputation creates is seen one level lower, as
the outputs of the operators it runs (a ``TorchDispatchMode``); the storages among them that stay alive are what it
holds for backward. torch's dispatch-mode base class and its graph-task id are private: this module is the only one
that names them, with the autograd node the engine runs (which tells one checkpointed unit's recomputation from the
next). Without the graph-task id (a torch that lacks it), a module's forward during the backward phase is taken for a
recomputation. torch's selective checkpointing (``create_selective_checkpoint_contexts``) runs its forward and its
recomputation under private dispatch modes of its own: the recomputation's tells a selective recomputation from a
whole one, the forward's holds the outputs kept for backward (outside autograd's saving, so outside the saved-tensor
hooks).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

_WALK = threading.local()
"""The node a backward walked outside autograd's engine runs now on this thread (``node``: its sequence number)."""


@contextlib.contextmanager
def walking_node(sequence_nr: int) -> Iterator[None]:
    """A backward run outside autograd's engine (the replay's walk on fake CUDA) runs node ``sequence_nr`` now.

    :func:`running_backward` and :func:`backward_node` answer from it as they would from the engine.
    """
    previous = getattr(_WALK, "node", None)
    _WALK.node = sequence_nr
    try:
        yield
    finally:
        _WALK.node = previous


def running_backward(default: bool) -> bool:
    """Whether the autograd engine is running a backward pass on this thread now (``default`` if torch cannot tell).

    >>> running_backward(default=True)
    False
    """
    if getattr(_WALK, "node", None) is not None:
        return True
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    if graph_task_id is None:
        return default
    running: bool = graph_task_id() != -1
    return running


def backward_node() -> int | None:
    """The sequence number of the autograd node the engine runs on this thread (``None``: none, or torch cannot tell).

    A checkpointed unit is recomputed inside the backward of the node that first unpacks what it saved: the modules
    one recomputation re-runs share this number, the next unit's recomputation has another.

    >>> backward_node() is None
    True
    """
    walked: int | None = getattr(_WALK, "node", None)
    if walked is not None:
        return walked
    current_node = getattr(torch._C, "_current_autograd_node", None)
    node = current_node() if current_node is not None else None
    return None if node is None else int(node._sequence_nr())


def selective_recomputation() -> bool:
    """Whether torch's selective checkpointing recomputes on this thread now (``False`` if torch cannot tell).

    Its recomputation runs under the dispatch mode that hands back the outputs its forward kept (the ops its policy
    saved) and recomputes the others: that mode on this thread's dispatch-mode stack.

    >>> selective_recomputation()
    False
    """
    replaying = getattr(torch_checkpoint, "_CachedTorchDispatchMode", None)
    return replaying is not None and any(isinstance(mode, replaying) for mode in _get_current_dispatch_mode_stack())


def selective_forward() -> object | None:
    """The mode with which torch's selective checkpointing runs a forward on this thread now (``None``: none).

    It keeps the outputs of the ops its policy saves until the recomputation reads them back (:func:`kept_outputs`).
    ``None`` too where torch cannot tell.

    >>> selective_forward() is None
    True
    """
    keeping = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
    if keeping is None:
        return None
    return next((mode for mode in reversed(_get_current_dispatch_mode_stack()) if isinstance(mode, keeping)), None)


def kept_outputs(mode: object) -> list[Tensor]:
    """The tensors selective checkpointing's forward ``mode`` (:func:`selective_forward`) keeps for backward now.

    Each op output its policy saved, until backward's recomputation reads it back (its entry is then replaced by a
    marker); empty where torch keeps them otherwise than this module knows.
    """
    wrapper = getattr(torch_checkpoint, "_VersionWrapper", None)
    entries = getattr(mode, "storage", None)
    if wrapper is None or not isinstance(entries, dict):
        return []
    kept = []
    for by_call in list(entries.values()):
        for entry in list(by_call.values()) if isinstance(by_call, dict) else ():
            for leaf in tree_leaves(entry):  # an op with several outputs keeps a tuple of them
                value = getattr(leaf, "val", None) if isinstance(leaf, wrapper) else None
                if isinstance(value, Tensor):
                    kept.append(value)
    return kept


# torch ships TorchDispatchMode without annotations.
class OutputWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Hands every operator's output to ``on_output`` between ``start`` and ``stop`` (called on one thread)."""

    def __init__(self, on_output: Callable[[Any], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._on_output = on_output

    def start(self) -> None:
        """Push the mode: from now on this thread's operators are shown to ``on_output``."""
        self.__enter__()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Pop the mode (it must be the innermost one)."""
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run the operator and show its output."""
        output = func(*args, **(kwargs or {}))
        self._on_output(output)
        return output


class Recomputation:
    """One module's forward re-run during backward (activation checkpointing): what it creates is held or freed."""

    def __init__(self, depth: int, on_output: Callable[[Any], None] | None) -> None:
        self.depth = depth
        """Length of the module stack outside the recomputed module: when it is back to this, the re-run ended."""
        self.thread = threading.get_ident()
        self.watch = OutputWatch(on_output) if on_output is not None else None
        if self.watch is not None:
            self.watch.start()

    def end(self) -> None:
        """Stop watching (on the thread that started, where the dispatch mode is)."""
        if self.watch is not None and threading.get_ident() == self.thread:
            self.watch.stop()
