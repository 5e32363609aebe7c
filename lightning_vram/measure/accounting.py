"""Counting training memory tensor by tensor: parameters, gradients, optimizer state, activations.

Every count is deduplicated by storage (``untyped_storage().data_ptr()``) and covers only tensors on
the monitored device, so views, tied weights and Adam's CPU ``step`` counters on a GPU run are not
counted twice or at all. Sharded tensors count as the shard this rank holds: a DTensor's local tensor
(FSDP2), FSDP1's flat parameter shard (its parameters are views of it), DeepSpeed ZeRO's partitions
(see ``deepspeed_zero``). Activations are the tensors autograd saves for backward, seen through
``torch.autograd.graph.saved_tensors_hooks`` on sampled steps only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_vram.measure._compiled import compiled_module_names
from lightning_vram.measure.deepspeed_zero import master_weights, parameter_partition, partition_gradients
from lightning_vram.measure.tensors import iter_tensors
from lightning_vram.records import Attribution, Breakdown, ModuleProfile, Phase

OUTSIDE_MODULES = "(training_step)"
"""Name given to activations saved outside any submodule's forward, such as the loss computation."""

ROOT_MODULE = "(root)"
"""Name given to the LightningModule itself."""

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

StorageBytes = dict[int, int]
"""Storage address -> storage size in bytes."""


def _dtensor_type() -> type[DTensor] | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


DTENSOR = _dtensor_type()
"""``torch.distributed.tensor.DTensor`` (FSDP2 and tensor-parallel parameters), or ``None`` without distributed."""


def local_tensor(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, any other tensor itself."""
    if DTENSOR is not None and isinstance(tensor, DTENSOR):
        local: Tensor = tensor.to_local()
        return local
    return tensor


def on_device(tensor: Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on ``device`` (an index-less device matches any index of its type)."""
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def add_storage(storages: StorageBytes, tensor: Tensor, device: torch.device, exclude: Iterable[int] = ()) -> None:
    """Add ``tensor``'s storage (a DTensor's local shard) unless it is elsewhere, empty, or in ``exclude``."""
    tensor = local_tensor(tensor)
    if not on_device(tensor, device):
        return
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key and key not in exclude:
        storages[key] = storage.nbytes()


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the first tensor in a batch (nested containers), or ``None``.

    >>> batch_size_of((torch.zeros(8, 3), torch.zeros(8)))
    8
    """
    for tensor in iter_tensors(batch):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def parameter_storages(module: nn.Module, device: torch.device) -> StorageBytes:
    """Storages of the module's parameters on ``device`` (tied weights once), with ZeRO-3's partitions."""
    storages: StorageBytes = {}
    for parameter in module.parameters():
        add_storage(storages, parameter, device)
        partition = parameter_partition(parameter)
        if partition is not None:
            add_storage(storages, partition, device)
    return storages


def gradient_storages(
    module: nn.Module, device: torch.device, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> StorageBytes:
    """Storages of the gradients alive now: on the module's parameters, and in ZeRO optimizers' partitions."""
    storages: StorageBytes = {}
    for parameter in module.parameters():
        if parameter.grad is not None:
            add_storage(storages, parameter.grad, device)
    for optimizer in optimizers:
        for gradient in partition_gradients(optimizer):
            add_storage(storages, gradient, device)
    return storages


def optimizer_state_storages(
    optimizers: Iterable[torch.optim.Optimizer], device: torch.device, exclude: Iterable[int]
) -> StorageBytes:
    """Storages of every optimizer's state on ``device``, minus those in ``exclude`` (parameters, gradients).

    A ZeRO optimizer's state includes its fp32 master copy of this rank's partition.
    """
    excluded = set(exclude)
    storages: StorageBytes = {}
    for optimizer in optimizers:
        for tensor in iter_tensors(list(optimizer.state.values())):
            add_storage(storages, tensor, device, excluded)
        for tensor in master_weights(optimizer):
            add_storage(storages, tensor, device, excluded)
    return storages


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes alive now on ``device``, each storage counted once."""
    optimizers = list(optimizers)
    parameters = parameter_storages(module, device)
    gradients = gradient_storages(module, device, optimizers)
    state = optimizer_state_storages(optimizers, device, set(parameters) | set(gradients))
    return sum(parameters.values()), sum(gradients.values()), sum(state.values())


class _SavedActivation:
    """What autograd keeps instead of a saved tensor while the ledger watches; freed when autograd frees it."""

    __slots__ = ("_key", "_ledger", "tensor")

    def __init__(self, tensor: Tensor, ledger: ActivationLedger, key: int) -> None:
        self.tensor = tensor
        self._ledger = ledger
        self._key = key

    def __del__(self) -> None:
        self._ledger.release(self._key)


class ActivationLedger:
    """Live bytes of the storages autograd holds for backward.

    A storage saved several times counts once; it is released when autograd drops its last saved
    reference (node by node during backward). Thread-safe: the autograd engine may release from
    its own threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._references: dict[int, int] = {}
        self._sizes: StorageBytes = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.saved_bytes_by_module: dict[str, int] = {}

    def acquire(self, key: int, nbytes: int, module_name: str) -> None:
        """Autograd saved a reference to storage ``key`` of ``nbytes`` bytes inside ``module_name``."""
        with self._lock:
            count = self._references.get(key, 0)
            self._references[key] = count + 1
            if count == 0:
                self._sizes[key] = nbytes
                self.live_bytes += nbytes
                self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
                self.saved_bytes_by_module[module_name] = self.saved_bytes_by_module.get(module_name, 0) + nbytes

    def start_segment(self) -> None:
        """Start measuring the highest live bytes again from what is live now."""
        with self._lock:
            self.peak_live_bytes = self.live_bytes

    def holds(self, key: int) -> bool:
        """Whether autograd holds storage ``key`` for backward now."""
        with self._lock:
            return key in self._references

    def release(self, key: int) -> None:
        """Autograd dropped one saved reference to storage ``key``."""
        with self._lock:
            count = self._references.get(key, 0) - 1
            if count > 0:
                self._references[key] = count
            elif count == 0:
                del self._references[key]
                self.live_bytes -= self._sizes.pop(key)


def storage_bytes(value: Any, device: torch.device) -> StorageBytes:
    """Unique storages of every tensor inside ``value`` (nested containers) on ``device``."""
    storages: StorageBytes = {}
    for tensor in iter_tensors(value):
        add_storage(storages, tensor, device)
    return storages


class _ModuleCounter:
    """Mutable tallies of one module during a sampled forward pass."""

    __slots__ = ("input_bytes", "input_saved_for_backward", "output_bytes")

    def __init__(self) -> None:
        self.input_bytes = 0
        self.output_bytes = 0
        self.input_saved_for_backward = False


class _GradientLedger:
    """Live gradient bytes during backward, and the highest activations + gradients seen together."""

    def __init__(self, gradients: StorageBytes, activations: ActivationLedger, device: torch.device) -> None:
        self._gradients = dict(gradients)
        self._activations = activations
        self._device = device
        self.peak_bytes = -1
        self.gradients_at_peak = 0
        self.activations_at_peak = 0
        self.observe()

    def add(self, gradient: Tensor) -> None:
        """A gradient was accumulated into a parameter."""
        add_storage(self._gradients, gradient, self._device)
        self.observe()

    def observe(self) -> None:
        """Record the current total if it is the highest so far."""
        gradient_bytes = sum(self._gradients.values())
        activation_bytes = self._activations.live_bytes
        if gradient_bytes + activation_bytes > self.peak_bytes:
            self.peak_bytes = gradient_bytes + activation_bytes
            self.gradients_at_peak = gradient_bytes
            self.activations_at_peak = activation_bytes


class StepAttributor:
    """Counts one sampled training step, phase by phase, tensor by tensor.

    Call ``begin_forward`` at batch start, ``before_backward`` and ``before_optimizer_step`` at those hooks
    (as often as they come: manual optimization may run several of each) and ``finish`` at batch end;
    ``close`` removes every hook and is safe at any time. Each boundary ends a segment: one that ends at a
    backward is a forward pass, one that ends at an optimizer step is the backward before it, the last one
    is whatever phase ran. The counted peak of each phase is:

    - forward: parameters + gradients alive when the segment began (the previous step's, unless freed) +
      optimizer state + the highest live bytes of saved activations in the segment;
    - backward: parameters + optimizer state + the highest sum of live activations and gradients
      while backward frees one and creates the other;
    - optimizer: parameters + gradients alive when it began (or after, if more) + optimizer state after the
      update + activations still held.
    """

    def __init__(self, step: int, module: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device):
        self._step = step
        self._module = module
        self._optimizers = optimizers
        self._device = device
        self._parameters = parameter_storages(module, device)
        self._ledger = ActivationLedger()
        self._module_stack: list[str] = []
        self._modules = {name or ROOT_MODULE: child for name, child in module.named_modules()}
        self.compiled = compiled_module_names(module)
        """Modules run by torch.compile: their saved tensors are counted, charged to the module as a whole."""
        self._counters: dict[str, _ModuleCounter] = {}
        self._batch_size: int | None = None
        self._handles: list[RemovableHandle] = []
        self._saved_tensors_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._gradient_handles: list[RemovableHandle] = []
        self._gradients: _GradientLedger | None = None
        self._segment_state: tuple[int, int] = (0, 0)
        self._phase = Phase.FORWARD
        self._phases: dict[Phase, Breakdown] = {}
        self.error: Exception | None = None
        """The first error raised inside the hooks; from then on they pass everything through untouched."""

    def _model_state(self) -> tuple[int, int]:
        """(gradient bytes, optimizer-state bytes) alive now."""
        _, gradient_bytes, state_bytes = model_state_bytes(self._module, self._optimizers, self._device)
        return gradient_bytes, state_bytes

    def begin_forward(self, batch: Any = None) -> None:
        """Count the state alive at batch start and watch saved tensors and module calls until ``finish``.

        Backward passes and optimizer updates (under ``no_grad``) save nothing, so the hooks can stay for the
        whole step and see every forward pass of it, as in a GAN's manual optimization.
        """
        self._segment_state = self._model_state()
        self._batch_size = batch_size_of(batch)
        for label, child in self._modules.items():
            if any(label.startswith(f"{outer}.") for outer in self.compiled):
                continue  # inside a compiled graph the hooks would not fire, and adding them forces recompiles
            self._handles.append(child.register_forward_pre_hook(self._make_enter(label)))
            self._handles.append(child.register_forward_hook(self._leave, always_call=True))
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._saved_tensors_hooks = hooks

    def _make_enter(self, label: str) -> Any:
        watch_inplace = isinstance(getattr(self._modules[label], "inplace", None), bool)

        def enter(_module: nn.Module, args: Any) -> None:
            if self.error is not None:
                return
            try:
                count(args)
            except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
                self.error = error

        def count(args: Any) -> None:
            counter = self._counters.get(label)
            if counter is None:
                counter = self._counters[label] = _ModuleCounter()
            inputs = storage_bytes(args, self._device)
            counter.input_bytes += sum(inputs.values())
            if watch_inplace and any(self._ledger.holds(key) for key in inputs):
                counter.input_saved_for_backward = True
            self._module_stack.append(label)

        return enter

    def _leave(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self.error is not None:
            return
        try:
            self._count_output(output)
        except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
            self.error = error

    def _count_output(self, output: Any) -> None:
        if self._module_stack:
            counter = self._counters.get(self._module_stack.pop())
            if counter is not None:
                counter.output_bytes += sum(storage_bytes(output, self._device).values())

    def _pack(self, tensor: Tensor) -> Any:
        if self.error is not None:
            return tensor
        try:
            return self._pack_counted(tensor)
        except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
            self.error = error
            return tensor

    def _pack_counted(self, tensor: Tensor) -> Any:
        if parameter_partition(tensor) is not None:
            return tensor  # a ZeRO-3 parameter, gathered for this layer: DeepSpeed frees it and gathers it again
        local = local_tensor(tensor)
        if not on_device(local, self._device):
            return tensor
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if not key or key in self._parameters:
            return tensor
        owner = self._module_stack[-1] if self._module_stack else OUTSIDE_MODULES
        self._ledger.acquire(key, storage.nbytes(), owner)
        return _SavedActivation(tensor, self._ledger, key)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _SavedActivation) else packed

    def before_backward(self) -> None:
        """A backward pass starts: what ran since the last boundary was a forward pass."""
        self._close_segment(Phase.FORWARD)
        self._phase = Phase.BACKWARD
        self._gradients = _GradientLedger(
            gradient_storages(self._module, self._device, self._optimizers), self._ledger, self._device
        )
        if not self._gradient_handles:
            for parameter in self._module.parameters():
                if parameter.requires_grad:
                    # torch ships this method without annotations.
                    handle = parameter.register_post_accumulate_grad_hook(self._on_gradient)  # type: ignore[no-untyped-call]
                    self._gradient_handles.append(handle)

    def _on_gradient(self, parameter: Tensor) -> None:
        if self.error is not None or self._gradients is None or parameter.grad is None:
            return
        try:
            self._gradients.add(parameter.grad)
        except Exception as error:  # noqa: BLE001 -- inside the user's backward: report, never raise
            self.error = error

    def before_optimizer_step(self) -> None:
        """An optimizer is about to step: close the segment that ran since the last boundary."""
        self._close_segment(self._phase)
        self._phase = Phase.OPTIMIZER

    def finish(self) -> Attribution:
        """Close the step's last segment, remove every hook, and return the counts."""
        self._close_segment(self._phase)
        self.close()
        return Attribution(
            step=self._step, phases=dict(self._phases), modules=self._module_profiles(), batch_size=self._batch_size
        )

    def _close_segment(self, phase: Phase) -> None:
        """Count the segment that ends now as ``phase``; a phase met twice in a step keeps its highest count."""
        gradient_bytes, state_bytes = self._model_state()
        start_gradients, start_state = self._segment_state
        gradients = self._gradients
        if phase is Phase.BACKWARD and gradients is not None:
            counted = self._breakdown(
                gradients.gradients_at_peak, max(start_state, state_bytes), gradients.activations_at_peak
            )
        elif phase is Phase.OPTIMIZER:  # the gradients it consumes, even if it frees them (DeepSpeed ZeRO-1/2)
            counted = self._breakdown(max(start_gradients, gradient_bytes), state_bytes, self._ledger.live_bytes)
        else:  # a forward pass: the gradients alive when it began stayed alive through it
            counted = self._breakdown(start_gradients, max(start_state, state_bytes), self._ledger.peak_live_bytes)
        known = self._phases.get(phase)
        if known is None or counted.counted_bytes > known.counted_bytes:
            self._phases[phase] = counted
        self._gradients = None
        self._segment_state = (gradient_bytes, state_bytes)
        self._ledger.start_segment()

    def _breakdown(self, gradient_bytes: int, state_bytes: int, activation_bytes: int) -> Breakdown:
        return Breakdown(
            parameters=sum(self._parameters.values()),
            gradients=gradient_bytes,
            optimizer_state=state_bytes,
            activations=activation_bytes,
            other=None,
        )

    def _module_profiles(self) -> tuple[ModuleProfile, ...]:
        """Every module called during the forward pass, in registration order, then code outside modules."""
        saved = self._ledger.saved_bytes_by_module
        profiles = []
        for label, counter in self._counters.items():
            inplace = getattr(self._modules[label], "inplace", None)
            profiles.append(
                ModuleProfile(
                    name=label,
                    type=type(self._modules[label]).__name__,
                    activation_bytes=saved.get(label, 0),
                    input_bytes=counter.input_bytes,
                    output_bytes=counter.output_bytes,
                    inplace=inplace if isinstance(inplace, bool) else None,
                    input_saved_for_backward=counter.input_saved_for_backward,
                )
            )
        order = {label: index for index, label in enumerate(self._modules)}
        profiles.sort(key=lambda profile: order[profile.name])
        if saved.get(OUTSIDE_MODULES):
            profiles.append(ModuleProfile(OUTSIDE_MODULES, "-", saved[OUTSIDE_MODULES]))
        return tuple(profiles)

    def close(self) -> None:
        """Remove every hook this step installed. Safe to call at any point, more than once."""
        hooks, self._saved_tensors_hooks = self._saved_tensors_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for handle in (*self._handles, *self._gradient_handles):
            handle.remove()
        self._handles.clear()
        self._gradient_handles.clear()
        self._module_stack.clear()
        self._gradients = None
