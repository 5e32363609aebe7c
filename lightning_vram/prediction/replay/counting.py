"""The monitor's count of one training step, phase by phase, for a step replayed under fake tensors.

The counter is the monitor's own :class:`~lightning_vram.measure.accounting.StepAttributor`, so that a replay can be
compared with a sampled step part by part; :data:`REPLAYED` says what differs. Storages are told apart by their
``StorageWeakRef`` identity (:func:`~lightning_vram.measure.storages.weak_identity`), as in a sampled step; what a
recomputation creates comes from the replay's :class:`~lightning_vram.prediction.replay.live.LiveMemory` through
:meth:`ReplayCounter.on_output`; saved tensors are checked for in-place changes, so that a change that breaks
backward raises here as it would in training; and an error inside the hooks ends the replay. Module profiles carry
the input and output bytes each module saved, not the :class:`~lightning_vram.measure.observations.ModuleObserver`'s
facts (feature maps, outputs held at the end of forward): those are the sampled step's. The counter also charges
each saved tensor to the op that produced it, to tell the loss's own share: a log-softmax's saved output that
cross-entropy (``nll_loss``) reads, not one a KL divergence or an entropy term reads, which no chunked cross-entropy
computes; nor one cross-entropy and such a term both read (a distillation's ``nll_loss(logp, y) + kl_div(logp, t)``):
a chunked cross-entropy leaves the term computing and saving it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_vram.measure._recompute import running_backward
from lightning_vram.measure.accounting import StepAttributor
from lightning_vram.measure.counting import Counting
from lightning_vram.measure.storages import storage_key
from lightning_vram.measure.tensors import op_tensors
from lightning_vram.prediction.replay.ops import op_name
from lightning_vram.records import Breakdown, ModuleProfile, Phase

REPLAYED = Counting(watch_recomputation=False, raise_errors=True)
"""A step replayed under fake tensors: storages known by identity, outputs from the replay, errors raised."""

Producer = Callable[[int], str | None]
"""Storage key -> the name of the op that produced it, when known."""


def _cross_entropy_own(name: str, read: torch.Tensor, tensors: list[torch.Tensor], output: Any) -> bool:
    """Whether an op ``name`` reads the log-probabilities ``read`` as cross-entropy does, or keeps nothing of them.

    ``tensors``: the op's tensor arguments; ``output``: what it returned. Label smoothing sums them over the classes
    (``sum``), times the class weights where there are some (``mul`` by a tensor of fewer elements); a read under
    ``no_grad`` or whose outputs are not floating (``argmax``, a comparison, for an accuracy) saves nothing of them.
    Any other read (a KL divergence's ``sub``, an entropy term's ``exp``)
    needs them whole however the cross-entropy is computed.
    """
    if not torch.is_grad_enabled() or not any(tensor.is_floating_point() for tensor in op_tensors(output)):
        return True
    if name == "sum":
        return len(tensors) == 1
    if name == "mul":
        return len(tensors) == 2 and all(tensor is read or tensor.numel() < read.numel() for tensor in tensors)
    return False


class ReplayCounter:
    """Counts one replayed step: call the boundaries in order, then :meth:`finish`; :meth:`close` is always safe.

    ``begin_forward`` → ``before_backward`` → ``before_optimizer_step`` → ``finish``, with every op's output handed
    to :meth:`on_output`. The module is the replay's own (fake) copy, so its hooks touch nothing of the user's.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        device: torch.device,
        producer: Producer,
        loss_ops: frozenset[str],
        loss_readers: frozenset[str],
    ) -> None:
        self._producer = producer
        self._loss_ops = loss_ops
        self._loss_readers = loss_readers
        self._attributor = StepAttributor(0, module, optimizers, device, counting=REPLAYED, on_saved=self._on_saved)
        self._saved_by_loss_ops: dict[int, int] = {}
        self._read_by_loss: set[int] = set()
        self._read_elsewhere: set[int] = set()

    @property
    def loss_activation_bytes(self) -> int:
        """Saved bytes produced by the loss's own ops (``loss_ops``: log-softmax) that ``loss_readers`` read.

        The readers are cross-entropy's (``nll_loss``): a log-softmax no cross-entropy reads (a KL divergence's, an
        entropy term's) is not a loss a chunked cross-entropy computes; nor is one such a term reads too, beside the
        cross-entropy (:func:`_cross_entropy_own`): a chunked cross-entropy leaves it computed and saved whole.
        """
        return sum(
            nbytes
            for key, nbytes in self._saved_by_loss_ops.items()
            if key in self._read_by_loss and key not in self._read_elsewhere
        )

    def _on_saved(self, key: int, nbytes: int) -> None:
        if self._producer(key) in self._loss_ops:
            self._saved_by_loss_ops[key] = self._saved_by_loss_ops.get(key, 0) + nbytes

    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """An op ran: where it is one of ``loss_readers``, its input's storage is the loss's.

        Where another op reads (in forward) what a loss op saved, otherwise than cross-entropy does, that storage is
        read elsewhere too (:func:`_cross_entropy_own`).
        """
        name = op_name(func)
        if name in self._loss_readers:
            if args and isinstance(args[0], torch.Tensor):
                self._read_by_loss.add(storage_key(args[0]))
            return
        if not self._saved_by_loss_ops or getattr(func, "is_view", False) or running_backward(default=False):
            return
        tensors = op_tensors((args, kwargs))
        for tensor in tensors:
            try:
                key = storage_key(tensor)
            except (NotImplementedError, RuntimeError):  # no storage (sparse)
                continue
            if key in self._saved_by_loss_ops and not _cross_entropy_own(name, tensor, tensors, output):
                self._read_elsewhere.add(key)

    def begin_forward(self) -> None:
        """The step starts: count the state alive at the first module call; watch saved tensors and module calls."""
        self._attributor.begin_forward()

    def on_output(self, output: Any) -> None:
        """An op created ``output``: while a forward is re-run in backward, hold its storages until they are freed."""
        self._attributor.on_output(output)

    @property
    def current_module(self) -> str | None:
        """The module whose forward runs now (``None`` outside any)."""
        return self._attributor.current_module

    def live_parts(self) -> tuple[int, int, int, int]:
        """(parameters, gradients, optimizer state, activations) alive now, in bytes."""
        return self._attributor.live_parts()

    def before_backward(self) -> None:
        """Backward starts: the segment since the step began was the forward pass."""
        self._attributor.before_backward()

    def before_optimizer_step(self) -> None:
        """The optimizer steps next: the segment since backward began was the backward pass."""
        self._attributor.before_optimizer_step()

    def after_backward(self) -> None:
        """A backward pass returned (manual optimization): its segment ends."""
        self._attributor.after_backward()

    def after_optimizer_step(self) -> None:
        """An optimizer's update returned (manual optimization): its segment ends."""
        self._attributor.after_optimizer_step()

    def finish(self) -> tuple[dict[Phase, Breakdown], tuple[ModuleProfile, ...]]:
        """Close the optimizer phase, remove every hook, and return the counted phases and module profiles."""
        attribution = self._attributor.finish()
        # Whether an output stayed saved and which feature map a Linear read are the sampled step's facts: a replay
        # leaves them unknown (their defaults).
        modules = tuple(
            replace(profile, output_saved_for_backward=False, input_feature_map=None, input_feature_map_dims=None)
            for profile in attribution.modules
        )
        return attribution.phases, modules

    def close(self) -> None:
        """Remove every hook; safe at any point, more than once."""
        self._attributor.close()
