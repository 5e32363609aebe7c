"""The activation-checkpointing frames a replay makes, let go when the replay fails.

``torch.utils.checkpoint`` (non-reentrant) keeps a ``_CheckpointFrame`` per checkpointed call, holding the function
that recomputes it (the replay's copy of the module and its inputs). When the recomputation raises in backward (a
checkpointed block that cannot run twice, the replay's deadline), autograd's graph, which the garbage collector cannot
see into, keeps the frame, and through it every fake tensor of the replay. The frames this thread makes while the
replay runs are recorded (weakly), and emptied when the replay fails.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch.utils import checkpoint


class CheckpointFrames:
    """Records the checkpoint frames the current thread makes while entered; :meth:`release` empties them."""

    def __init__(self) -> None:
        self._frames: weakref.WeakSet[Any] = weakref.WeakSet()
        self._original: Any = None

    def __enter__(self) -> CheckpointFrames:
        frame_class = getattr(checkpoint, "_CheckpointFrame", None)
        if frame_class is None:  # a torch without non-reentrant frames: nothing to record
            return self
        original = frame_class.__init__
        thread = threading.get_ident()
        frames = self._frames

        def recorded(frame: Any, *args: Any, **kwargs: Any) -> None:
            original(frame, *args, **kwargs)
            if threading.get_ident() == thread:
                frames.add(frame)

        self._original = original
        frame_class.__init__ = recorded  # put back by __exit__
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._original is not None:
            checkpoint._CheckpointFrame.__init__ = self._original  # type: ignore[method-assign]
            self._original = None

    def recorded(self) -> list[Any]:
        """The frames recorded so far that are still alive."""
        return list(self._frames)

    def release(self) -> None:
        """Empty every recorded frame (the replay failed: nothing will recompute through them again)."""
        for frame in list(self._frames):
            vars(frame).clear()
        self._frames.clear()
