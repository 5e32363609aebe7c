"""The monitor's count of one training step, phase by phase, for a step replayed under fake tensors.

The definitions are :class:`~lightning_vram.measure.accounting.StepAttributor`'s, so that a replay can be compared
with a sampled step part by part:

- forward: parameters + gradients alive at the forward pass's first module call + optimizer state + the highest
  live bytes of saved activations;
- backward: parameters + optimizer state + the highest sum of live activations and gradients; a module's forward
  re-run during backward (activation checkpointing) adds what it creates, while those storages live;
- optimizer: parameters + gradients (the higher of before and after the update) + optimizer state after it +
  activations still held.

Only the storage identity differs
(:func:`~lightning_vram.advice.replay.storages.storage_key`); module profiles carry what the monitor's
:class:`~lightning_vram.measure.observations.ModuleObserver` tells from storage keys (the input and output bytes
each module saved), not what it tells from data pointers (feature maps, outputs held at the end of forward). The
counter also charges each saved tensor to the op that produced it, to tell the loss's own share.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_vram.advice.replay.storages import (
    StorageBytes,
    add_storage,
    gradient_storages,
    optimizer_state_storages,
    parameter_storages,
    storage_bytes,
    storage_identity,
    storage_key,
)
from lightning_vram.measure.accounting import (
    OUTSIDE_MODULES,
    ROOT_MODULE,
    ActivationLedger,
    ModuleTally,
    module_profile,
    on_device,
    phase_breakdown,
)
from lightning_vram.measure.observations import ModuleObserver
from lightning_vram.measure.tensors import iter_tensors, without_history
from lightning_vram.records import Breakdown, ModuleProfile, Phase

Producer = Callable[[int], str | None]
"""Storage key -> the name of the op that produced it, when known."""


class _Saved:
    """What autograd keeps instead of a saved tensor while the counter watches; released when autograd frees it.

    Saved-tensor hooks replace autograd's own check that a saved tensor was not modified in place before backward
    used it; :meth:`unpack` makes the same check, so a change that breaks backward (a checkpointed unit starting
    with an inplace op) raises in the replay as it would in training.
    """

    __slots__ = ("_key", "_ledger", "_version", "tensor")

    def __init__(self, tensor: Tensor, ledger: ActivationLedger, key: int) -> None:
        self.tensor = without_history(tensor)
        self._ledger = ledger
        self._key = key
        self._version = tensor._version

    def unpack(self) -> Tensor:
        """The saved tensor, unless it was modified in place since it was saved."""
        tensor = self.tensor
        if tensor._version != self._version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation:"
                f" a {list(tensor.shape)} tensor saved at version {self._version} is at version {tensor._version}"
            )
        return tensor

    def __del__(self) -> None:
        self._ledger.release(self._key)


class ReplayCounter:
    """Counts one replayed step: call the boundaries in order, then :meth:`finish`; :meth:`close` is always safe.

    ``begin_forward`` → ``before_backward`` → ``before_optimizer_step`` → ``finish``. The module is the replay's
    own (fake) copy, so its hooks touch nothing of the user's.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        device: torch.device,
        producer: Producer,
        loss_ops: frozenset[str],
    ) -> None:
        self._module = module
        self._optimizers = optimizers
        self._device = device
        self._producer = producer
        self._loss_ops = loss_ops
        self._parameters = parameter_storages(module, device)
        self._ledger = ActivationLedger()
        self._modules = {name or ROOT_MODULE: child for name, child in module.named_modules()}
        self._stack: list[str] = []
        self._tallies: dict[str, ModuleTally] = {}
        self._observer = ModuleObserver(storage_identity)
        self._phase = Phase.FORWARD
        self._awaiting_forward = False
        self._recomputing_depth: int | None = None
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self._handles: list[RemovableHandle] = []
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._segment_state = (0, 0)
        self._phases: dict[Phase, Breakdown] = {}
        self._gradients: StorageBytes = {}
        self._backward_peak: tuple[int, int] | None = None
        self.loss_activation_bytes = 0
        """Saved bytes produced by the loss's own ops (``loss_ops``: log-softmax and the like)."""

    def _model_state(self) -> tuple[int, int]:
        parameters = self._parameters
        gradients = gradient_storages(self._module, self._device)
        state = optimizer_state_storages(self._optimizers, self._device, set(parameters) | set(gradients))
        return sum(gradients.values()), sum(state.values())

    def begin_forward(self) -> None:
        """The step starts: count the state alive at the first module call; watch saved tensors and module calls."""
        self._segment_state = self._model_state()
        self._awaiting_forward = True
        for label, child in self._modules.items():
            self._handles.append(child.register_forward_pre_hook(self._make_enter(label)))
            self._handles.append(child.register_forward_hook(self._leave, always_call=True))
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._saved_hooks = hooks

    def _make_enter(self, label: str) -> Callable[[nn.Module, Any], None]:
        def enter(module: nn.Module, args: Any) -> None:
            if self._phase is Phase.BACKWARD:  # a forward re-run by activation checkpointing
                if self._recomputing_depth is None:
                    self._recomputing_depth = len(self._stack)
                self._stack.append(label)
                return
            if self._awaiting_forward:
                self._awaiting_forward = False
                self._segment_state = self._model_state()
            tally = self._tallies.setdefault(label, ModuleTally())
            inputs = storage_bytes(args, self._device)
            tally.input_bytes += sum(inputs.values())
            if any(self._ledger.holds(key) for key in inputs):
                tally.input_saved_for_backward = True
            self._observer.enter(label, module, args, inputs)
            self._stack.append(label)

        return enter

    def _leave(self, module: nn.Module, _args: Any, output: Any) -> None:
        if not self._stack:
            return
        label = self._stack.pop()
        depth = self._recomputing_depth
        if depth is not None:
            if len(self._stack) <= depth:
                self._recomputing_depth = None
                self._observe_backward()
            return
        outputs = storage_bytes(output, self._device)
        tally = self._tallies.get(label)
        if tally is not None:
            tally.output_bytes += sum(outputs.values())
        self._observer.leave(label, module, output, outputs)

    def on_output(self, output: Any) -> None:
        """An op created ``output``: while a forward is re-run in backward, hold its storages until they are freed."""
        if self._recomputing_depth is None:
            return
        for tensor in iter_tensors(output):
            if not on_device(tensor, self._device):
                continue
            key, storage = storage_key(tensor), tensor.untyped_storage()
            if key in self._parameters or not storage.nbytes():
                continue
            if self._ledger.hold_recomputed(key, storage.nbytes()):
                self._finalizers.append(weakref.finalize(storage, self._ledger.free_recomputed, key))

    def _pack(self, tensor: Tensor) -> Any:
        if not on_device(tensor, self._device):
            return without_history(tensor)
        key = storage_key(tensor)
        nbytes = tensor.untyped_storage().nbytes()
        if not nbytes or key in self._parameters:
            return without_history(tensor)
        if not self._ledger.holds(key) and self._producer(key) in self._loss_ops:
            self.loss_activation_bytes += nbytes
        self._ledger.acquire(key, nbytes, self._stack[-1] if self._stack else OUTSIDE_MODULES)
        self._observer.saved(key)
        return _Saved(tensor, self._ledger, key)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        unpacked: Tensor = packed.unpack() if isinstance(packed, _Saved) else packed
        return unpacked

    def before_backward(self) -> None:
        """Backward starts: the segment since the step began was the forward pass."""
        self._observer.forward_ended(self._ledger.holds)
        self._close_segment(Phase.FORWARD)
        self._phase = Phase.BACKWARD
        self._gradients = gradient_storages(self._module, self._device)
        self._backward_peak = None
        self._observe_backward()
        for parameter in self._module.parameters():
            if parameter.requires_grad:
                # torch ships this method without annotations.
                handle = parameter.register_post_accumulate_grad_hook(self._on_gradient)  # type: ignore[no-untyped-call]
                self._handles.append(handle)

    def _on_gradient(self, parameter: Tensor) -> None:
        if parameter.grad is not None:
            add_storage(self._gradients, parameter.grad, self._device)
            self._observe_backward()

    def _observe_backward(self) -> None:
        gradient_bytes, activation_bytes = sum(self._gradients.values()), self._ledger.live_bytes
        peak = self._backward_peak
        if peak is None or gradient_bytes + activation_bytes > sum(peak):
            self._backward_peak = (gradient_bytes, activation_bytes)

    def before_optimizer_step(self) -> None:
        """The optimizer steps next: the segment since backward began was the backward pass."""
        self._close_segment(Phase.BACKWARD)
        self._phase = Phase.OPTIMIZER

    def finish(self) -> tuple[dict[Phase, Breakdown], tuple[ModuleProfile, ...]]:
        """Close the optimizer phase, remove every hook, and return the counted phases and module profiles."""
        self._close_segment(Phase.OPTIMIZER)
        self.close()
        return dict(self._phases), self._module_profiles()

    def _close_segment(self, phase: Phase) -> None:
        now = self._model_state()
        parameter_bytes = sum(self._parameters.values())
        self._phases[phase] = phase_breakdown(
            phase, parameter_bytes, self._segment_state, now, self._ledger, self._backward_peak
        )
        self._segment_state = now
        self._awaiting_forward = False
        self._ledger.start_segment()

    def _module_profiles(self) -> tuple[ModuleProfile, ...]:
        saved = self._ledger.saved_bytes_by_module
        order = {label: index for index, label in enumerate(self._modules)}
        profiles = []
        for label in sorted(self._tallies, key=order.__getitem__):
            profile = module_profile(
                label, self._modules[label], saved.get(label, 0), self._tallies[label], self._observer.facts(label)
            )
            # Whether an output stayed saved and which feature map a Linear read are told by data pointers, which
            # fake storages lack: a replay leaves them unknown (their defaults).
            profiles.append(replace(profile, output_saved_for_backward=False, input_feature_map=None))
        if saved.get(OUTSIDE_MODULES):
            profiles.append(ModuleProfile(OUTSIDE_MODULES, "-", saved[OUTSIDE_MODULES]))
        return tuple(profiles)

    def close(self) -> None:
        """Remove every hook; safe at any point, more than once."""
        hooks, self._saved_hooks = self._saved_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
