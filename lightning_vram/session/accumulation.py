"""Gradient accumulation as a loop runs it: the batches per optimizer step, declared and observed.

A session is told ``before_optimizer_step`` in each batch whose optimizer steps; a batch that ends without one is a
micro-batch of an accumulation window. The window observed is the most batches that ended between two optimizer
steps, the stepping one included (or from the run's first batch to its first step, where the run did not resume
from saved state): a shorter window, as at an epoch's end, is a partial one. Until a loop has stepped once (and in a
loop that never says so) the declared window stands. Where a set-up is given and no window declared (the callback's,
whose ``accumulate_grad_batches`` is the Trainer's own setting), the set-up's window stands and none is observed.

Where no window is known (none declared, no set-up given), a sampled step with no optimizer step before it that
holds gradients from an earlier batch may be a micro-batch of a first window longer than the steps before it (its
optimizer state does not exist yet): its replay waits, once a run, and the window's next stepping micro-batch is
sampled once the window is observed (:meth:`AccumulationWindows.defers`, :meth:`AccumulationWindows.resample_at`).
A loop that never calls ``before_optimizer_step`` has the next batch sampled and replayed instead, as before.

A sampled micro-batch that does not step may hold less than the window's later ones (the first holds no gradients
before its backward): the window's stepping micro-batch is sampled too (:meth:`AccumulationWindows.stepping_step`),
so that the report's peak is measured on a micro-batch holding the window's gradients, and says which one it was
(:meth:`AccumulationWindows.place`).
"""

from __future__ import annotations

from lightning_vram.exceptions import warn


class AccumulationWindows:
    """The accumulation window of one run: ``accumulate_grad_batches`` as declared and as observed.

    Args:
        declared: the window the user declared (``VramSession.start``'s ``accumulate_grad_batches``); ``None``: not
            declared (the set-up's own value stands until one is observed, and no disagreement is warned about).
        from_setup: a set-up was given (a Trainer's): with none declared, its window stands, not the observed one.
    """

    def __init__(self, declared: int | None = None, from_setup: bool = False) -> None:
        self.declared = declared
        self.from_setup = from_setup and declared is None
        self.observed: int | None = None
        """The most batches observed per optimizer step (``None``: no complete window observed yet)."""
        self.stepped = False
        """Whether the batch now running has called ``before_optimizer_step``."""
        self.steps_seen = 0
        """Batches that ended with an optimizer step."""
        self.last_stepped = False
        """Whether the last batch that ended stepped."""
        self._since: int | None = 0  # batches ended since the last optimizer step (None: since an unknown point)
        self._warned = False
        self._deferred: bool | None = None  # a replay waits for the first optimizer step (False: it waited once)

    def optimizer_step(self) -> None:
        """The batch now running steps an optimizer (called once or more per stepping batch)."""
        self.stepped = True

    def batch_end(self) -> None:
        """A batch ends: where it stepped, the batches since the previous step make a window."""
        since = None if self._since is None else self._since + 1
        self.last_stepped = self.stepped
        if not self.stepped:
            self._since = since
            return
        if since is not None:
            self.observed = max(self.observed or 0, since)
        self.steps_seen += 1
        self._since, self.stepped = 0, False

    def resumed(self) -> None:
        """The run continues from saved state: the batches before its first step may be a window's tail."""
        self._since = None

    def window(self, default: int) -> int:
        """The run's window: the observed one, else the declared one, else ``default`` (the set-up's own).

        Warns once (:class:`~lightning_vram.exceptions.VramMonitorWarning`) where the declared window is not the
        observed one.
        """
        observed = self.observed
        if observed is None or self.from_setup:
            return self.declared if self.declared is not None else default
        if self.declared is not None and observed != self.declared and not self._warned:
            self._warned = True
            warn(
                f"VramSession: accumulate_grad_batches={self.declared} was declared, but the optimizer stepped once"
                f" every {observed} batch(es) (before_optimizer_step): the replay and the advice use {observed}"
            )
        return observed

    def place(self) -> int | None:
        """The running batch's place in its window, 1-based (``None``: not known, a run resumed before its first step).

        Read before :meth:`batch_end`.
        """
        return None if self._since is None else self._since + 1

    def stepping_step(self, step: int, window: int) -> int | None:
        """Where the running batch ``step`` does not step its optimizer, the step expected to end its window.

        ``window``: the run's window (:meth:`window`). The window's last place, else (the batch's place unknown, or
        at or past the window's length: a window longer than the one known) the next batch. ``None``: the batch
        steps, or the run does not accumulate. Read before :meth:`batch_end`.

        >>> windows = AccumulationWindows(declared=4)
        >>> windows.batch_end()
        >>> windows.stepping_step(1, 4), windows.stepping_step(1, 1)
        (3, None)
        """
        if self.stepped or window <= 1:
            return None
        place = self.place()
        return step + 1 if place is None or place >= window else step + window - place

    def defers(self, step: int, carried_gradient_bytes: int) -> bool:
        """Whether the replay of sampled step ``step`` (just ended) waits until the window is observed.

        Once a run, where no window is known and no optimizer step came before it, for a step past the first whose
        forward pass held ``carried_gradient_bytes`` of gradients from earlier batches (as a micro-batch does).
        """
        stepped_before = self.steps_seen > (1 if self.last_stepped else 0)
        known = self.from_setup or self.declared is not None
        if known or stepped_before or self._deferred is not None or step < 1 or carried_gradient_bytes <= 0:
            return False
        self._deferred = True
        return True

    def resample_at(self, steps: int) -> int | None:
        """The step to sample for the replay that waited, once the batch that ended (``steps`` have) stepped first.

        The window's next stepping micro-batch: ``steps - 1`` plus the window observed. ``None``: none waits, or the
        optimizer has not stepped yet.
        """
        if not self._deferred or not self.steps_seen:
            return None
        self._deferred = False
        return steps - 1 + (self.observed or 1)
