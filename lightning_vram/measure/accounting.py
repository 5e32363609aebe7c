"""Counting training memory tensor by tensor: parameters, gradients, optimizer state, activations.

Every count is deduplicated by storage (``untyped_storage().data_ptr()``) and covers only tensors on
the monitored device, so views, tied weights and Adam's CPU ``step`` counters on a GPU run are not
counted twice or at all. Sharded tensors count as the shard this rank holds: a DTensor's local tensor
(FSDP2), FSDP1's flat parameter shard (its parameters are views of it), DeepSpeed ZeRO's partitions
(see ``deepspeed_zero``). Activations are the tensors autograd saves for backward, seen through
``torch.autograd.graph.saved_tensors_hooks`` on sampled steps only.

Tensors without one dense storage count by the storages that hold their data: a sparse tensor its indices and
values, a tensor subclass that flattens (``__tensor_flatten__``) its inner tensors. Uninitialised parameters
(``nn.LazyLinear`` before its first forward) hold nothing yet and count once materialised. A tensor whose data
cannot be reached at all (an opaque MKL-DNN tensor) is skipped, and the counting says which kinds it skipped.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from lightning_vram.measure._recompute import OutputWatch, running_backward
from lightning_vram.measure.compiled import compiled_module_names
from lightning_vram.measure.deepspeed_zero import master_weights, parameter_partition, partition_gradients
from lightning_vram.measure.observations import ModuleFacts, ModuleObserver, stored_attribute
from lightning_vram.measure.tensors import iter_tensors, without_history
from lightning_vram.records import Attribution, Breakdown, ModuleProfile, NotMeasured, Phase

OUTSIDE_MODULES = "(training_step)"
"""Name given to activations saved outside any submodule's forward, such as the loss computation."""

ROOT_MODULE = "(root)"
"""Name given to the LightningModule itself."""

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class StorageBytes(dict[int, int]):
    """Storage address -> storage size in bytes, and the kinds of tensors met whose data could not be reached."""

    def __init__(self) -> None:
        super().__init__()
        self.uncounted: set[str] = set()
        """Kinds of tensors skipped (``tensor_kind``): they have no storage the counting can read."""


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


SPARSE_COMPONENTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_indices", "_values"),  # the public indices() refuses the uncoalesced gradients of Embedding
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
"""The methods giving a sparse tensor's dense components, by layout."""


def tensor_storages(tensor: Tensor) -> list[torch.UntypedStorage] | None:
    """The storages holding ``tensor``'s data, or ``None`` where they cannot be reached.

    A dense tensor has one; a sparse one the storages of its indices and values; a tensor subclass that
    flattens (``__tensor_flatten__``: DTensor, jagged nested tensors) those of its inner tensors. An
    uninitialised parameter has none yet.

    >>> dense = torch.zeros(4, 4)
    >>> [storage.nbytes() for storage in tensor_storages(dense)]
    [64]
    >>> [storage.nbytes() for storage in tensor_storages(torch.eye(3).to_sparse())]  # 2 x 3 int64, 3 float32
    [48, 12]
    """
    if is_lazy(tensor):
        return []
    components = SPARSE_COMPONENTS.get(tensor.layout)
    if components is not None:
        return [getattr(tensor, name)().untyped_storage() for name in components]
    if type(tensor) is not Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _context = tensor.__tensor_flatten__()
        storages: list[torch.UntypedStorage] = []
        for name in names:
            inner = getattr(tensor, name, None)
            found = tensor_storages(inner) if isinstance(inner, Tensor) else []
            if found is None:
                return None
            storages += found
        return storages
    try:
        return [tensor.untyped_storage()]
    except (NotImplementedError, RuntimeError):  # an opaque tensor (MKL-DNN) or a subclass without real storage
        return None


def tensor_kind(tensor: Tensor) -> str:
    """How the report names a kind of tensor: its class and layout.

    >>> tensor_kind(torch.eye(2).to_sparse())
    'Tensor (torch.sparse_coo)'
    """
    return f"{type(tensor).__name__} ({tensor.layout})"


def add_storage(storages: StorageBytes, tensor: Tensor, device: torch.device, exclude: Iterable[int] = ()) -> None:
    """Add ``tensor``'s storages (a DTensor's local shard) unless they are elsewhere, empty, or in ``exclude``.

    A tensor whose data cannot be reached is noted in ``storages.uncounted`` instead.
    """
    tensor = local_tensor(tensor)
    if not on_device(tensor, device):
        return
    found = tensor_storages(tensor)
    if found is None:
        storages.uncounted.add(tensor_kind(tensor))
        return
    for storage in found:
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
    storages = StorageBytes()
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
    storages = StorageBytes()
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
    storages = StorageBytes()
    for optimizer in optimizers:
        for tensor in iter_tensors(list(optimizer.state.values())):
            add_storage(storages, tensor, device, excluded)
        for tensor in master_weights(optimizer):
            add_storage(storages, tensor, device, excluded)
    return storages


def model_state_storages(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device
) -> tuple[StorageBytes, StorageBytes, StorageBytes]:
    """(parameter, gradient, optimizer-state) storages alive now on ``device``, each storage in one of them."""
    optimizers = list(optimizers)
    parameters = parameter_storages(module, device)
    gradients = gradient_storages(module, device, optimizers)
    state = optimizer_state_storages(optimizers, device, set(parameters) | set(gradients))
    return parameters, gradients, state


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], device: torch.device
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes alive now on ``device``, each storage counted once."""
    parameters, gradients, state = model_state_storages(module, optimizers, device)
    return sum(parameters.values()), sum(gradients.values()), sum(state.values())


class _SavedActivation:
    """What autograd keeps instead of a saved tensor while the ledger watches; freed when autograd frees it."""

    __slots__ = ("_keys", "_ledger", "tensor")

    def __init__(self, tensor: Tensor, ledger: ActivationLedger, keys: tuple[int, ...]) -> None:
        self.tensor = without_history(tensor)
        self._ledger = ledger
        self._keys = keys

    def __del__(self) -> None:
        for key in self._keys:
            self._ledger.release(key)


class ActivationLedger:
    """Live bytes of the storages autograd holds for backward.

    A storage saved several times counts once; it is released when autograd drops its last saved
    reference (node by node during backward). Storages a recomputation under activation checkpointing
    holds (``hold_recomputed``) count as well, until they are freed. Thread-safe: the autograd engine
    may release from its own threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._references: dict[int, int] = {}
        self._recomputed: set[int] = set()
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.saved_bytes_by_module: dict[str, int] = {}

    def _add_live(self, key: int, nbytes: int) -> None:
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def acquire(self, key: int, nbytes: int, module_name: str | None) -> None:
        """Autograd saved a reference to storage ``key`` of ``nbytes`` bytes inside ``module_name``.

        ``None`` for a tensor saved during backward (a reentrant checkpoint's recomputation): it counts as live
        but is not what the module saves in its forward pass.
        """
        with self._lock:
            count = self._references.get(key, 0)
            self._references[key] = count + 1
            if count == 0:
                if key not in self._recomputed:
                    self._add_live(key, nbytes)
                if module_name is not None:
                    by_module = self.saved_bytes_by_module
                    by_module[module_name] = by_module.get(module_name, 0) + nbytes

    def hold_recomputed(self, key: int, nbytes: int) -> bool:
        """A recomputation created storage ``key`` of ``nbytes`` bytes; ``False`` if it is held already."""
        with self._lock:
            if key in self._references or key in self._recomputed:
                return False
            self._recomputed.add(key)
            self._add_live(key, nbytes)
            return True

    def free_recomputed(self, key: int) -> None:
        """Storage ``key`` that a recomputation created was freed (or is no longer watched)."""
        with self._lock:
            if key in self._recomputed:
                self._recomputed.discard(key)
                if key not in self._references:
                    self.live_bytes -= self._sizes.pop(key)

    def start_segment(self) -> None:
        """Start measuring the highest live bytes again from what is live now."""
        with self._lock:
            self.peak_live_bytes = self.live_bytes

    def holds(self, key: int) -> bool:
        """Whether autograd holds storage ``key`` for backward now."""
        with self._lock:
            return key in self._references or key in self._recomputed

    def release(self, key: int) -> None:
        """Autograd dropped one saved reference to storage ``key``."""
        with self._lock:
            count = self._references.get(key, 0) - 1
            if count > 0:
                self._references[key] = count
            elif count == 0:
                del self._references[key]
                if key not in self._recomputed:
                    self.live_bytes -= self._sizes.pop(key)


def storage_bytes(value: Any, device: torch.device) -> StorageBytes:
    """Unique storages of every tensor inside ``value`` (nested containers) on ``device``."""
    storages = StorageBytes()
    for tensor in iter_tensors(value):
        add_storage(storages, tensor, device)
    return storages


class ModuleTally:
    """Mutable tallies of one module during a sampled (or replayed) forward pass, in bytes."""

    __slots__ = ("input_bytes", "input_saved_for_backward", "output_bytes")

    def __init__(self) -> None:
        self.input_bytes = 0
        self.output_bytes = 0
        self.input_saved_for_backward = False


def phase_breakdown(
    phase: Phase,
    parameter_bytes: int,
    start: tuple[int, int],
    now: tuple[int, int],
    activations: ActivationLedger,
    backward_peak: tuple[int, int] | None,
) -> Breakdown:
    """The counted peak of a segment of a step that ran ``phase`` (the definitions in :class:`StepAttributor`).

    ``start`` and ``now`` are (gradient bytes, optimizer-state bytes) when the segment began and now;
    ``backward_peak`` is (gradients, activations) at backward's highest sum of the two, where it was followed.
    The same rule counts sampled steps and replayed ones.
    """
    (start_gradients, start_state), (gradient_bytes, state_bytes) = start, now
    if phase is Phase.BACKWARD and backward_peak is not None:
        gradients, live = backward_peak
        return Breakdown(parameter_bytes, gradients, max(start_state, state_bytes), live, None)
    if phase is Phase.OPTIMIZER:  # the gradients it consumes, even if it frees them (DeepSpeed ZeRO-1/2)
        return Breakdown(
            parameter_bytes, max(start_gradients, gradient_bytes), state_bytes, activations.live_bytes, None
        )
    # A forward pass: the gradients alive when it began stayed alive through it.
    return Breakdown(parameter_bytes, start_gradients, max(start_state, state_bytes), activations.peak_live_bytes, None)


def module_profile(
    label: str, module: nn.Module, saved_bytes: int, tally: ModuleTally, facts: ModuleFacts
) -> ModuleProfile:
    """What module ``label`` did in a counted forward pass, from its tally and what the observer saw of it."""
    inplace = stored_attribute(module, "inplace")
    return ModuleProfile(
        name=label,
        type=type(module).__name__,
        activation_bytes=saved_bytes,
        input_bytes=tally.input_bytes,
        output_bytes=tally.output_bytes,
        inplace=inplace if isinstance(inplace, bool) else None,
        input_saved_for_backward=tally.input_saved_for_backward,
        input_saved_bytes=facts.input_saved_bytes,
        output_saved_bytes=facts.output_saved_bytes,
        output_saved_for_backward=facts.output_saved_for_backward,
        input_feature_map=facts.input_feature_map,
    )


class _GradientLedger:
    """Live gradient bytes during backward, and the highest activations + gradients seen together.

    Gradients are kept per parameter, so a gradient that accumulation replaces by a new tensor (a sparse one)
    stops counting when it is replaced.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        activations: ActivationLedger,
        device: torch.device,
    ) -> None:
        self._device = device
        self._activations = activations
        self._by_tensor: dict[int, StorageBytes] = {}
        for parameter in module.parameters():
            if parameter.grad is not None:
                self._by_tensor[id(parameter)] = self._storages(parameter.grad)
        partitions = StorageBytes()  # ZeRO's gradient partitions, read once at the start of backward
        for optimizer in optimizers:
            for gradient in partition_gradients(optimizer):
                add_storage(partitions, gradient, device)
        self._by_tensor[id(self)] = partitions
        self.peak_bytes = -1
        self.gradients_at_peak = 0
        self.activations_at_peak = 0
        self.observe()

    def _storages(self, gradient: Tensor) -> StorageBytes:
        storages = StorageBytes()
        add_storage(storages, gradient, self._device)
        return storages

    @property
    def uncounted(self) -> set[str]:
        """Kinds of gradient tensors whose data could not be reached."""
        return {kind for storages in self._by_tensor.values() for kind in storages.uncounted}

    def add(self, parameter: Tensor, gradient: Tensor) -> None:
        """``parameter``'s gradient is now ``gradient``."""
        self._by_tensor[id(parameter)] = self._storages(gradient)
        self.observe()

    def observe(self) -> None:
        """Record the current total if it is the highest so far."""
        unique: dict[int, int] = {}
        for storages in self._by_tensor.values():
            unique.update(storages)
        gradient_bytes = sum(unique.values())
        activation_bytes = self._activations.live_bytes
        if gradient_bytes + activation_bytes > self.peak_bytes:
            self.peak_bytes = gradient_bytes + activation_bytes
            self.gradients_at_peak = gradient_bytes
            self.activations_at_peak = activation_bytes


class _Recomputation:
    """One module's forward re-run during backward (activation checkpointing): what it creates is held or freed."""

    def __init__(self, depth: int, on_output: Any) -> None:
        self.depth = depth
        """Length of the module stack outside the recomputed module: when it is back to this, the re-run ended."""
        self.thread = threading.get_ident()
        self.watch = OutputWatch(on_output)
        self.watch.start()

    def end(self) -> None:
        """Stop watching (on the thread that started, where the dispatch mode is)."""
        if threading.get_ident() == self.thread:
            self.watch.stop()


class StepAttributor:
    """Counts one sampled training step, phase by phase, tensor by tensor.

    Call ``begin_forward`` at batch start, ``before_backward`` and ``before_optimizer_step`` at those hooks
    (as often as they come: manual optimization may run several of each) and ``finish`` at batch end;
    ``close`` removes every hook and is safe at any time. Each boundary ends a segment: one that ends at a
    backward is a forward pass, one that ends at an optimizer step is the backward before it, the last one
    is whatever phase ran. The counted peak of each phase is:

    - forward: parameters + gradients alive when the forward pass began (at its first module call, which
      is after the LightningModule's own ``on_train_batch_start``: the previous step's gradients, unless
      freed) + optimizer state + the highest live bytes of saved activations in the segment;
    - backward: parameters + optimizer state + the highest sum of live activations and gradients
      while backward frees one and creates the other; a module's forward re-run during backward by
      activation checkpointing adds what it creates and still holds when it ends;
    - optimizer: parameters + gradients alive when it began (or after, if more) + optimizer state after the
      update + activations still held.

    Uninitialised parameters count once materialised; tensors whose data cannot be reached are skipped and
    listed in ``notes``.
    """

    def __init__(
        self,
        step: int,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        device: torch.device,
        notes: dict[str, NotMeasured] | None = None,
    ):
        self._step = step
        self._module = module
        self._optimizers = optimizers
        self._device = device
        self.notes: dict[str, NotMeasured] = notes if notes is not None else {}
        """What the counting skipped and why, by what; shared with the caller when it passes its own dict."""
        self._lazy_parameters = True
        self._parameters = StorageBytes()
        self._refresh_parameters()
        self._ledger = ActivationLedger()
        self._module_stack: list[str] = []
        self._modules = {name or ROOT_MODULE: child for name, child in module.named_modules()}
        self.compiled = compiled_module_names(module)
        """Modules run by torch.compile: their saved tensors are counted, charged to the module as a whole."""
        self._counters: dict[str, ModuleTally] = {}
        self._observer = ModuleObserver()
        self._batch_size: int | None = None
        self._handles: list[RemovableHandle] = []
        self._saved_tensors_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._gradient_handles: list[RemovableHandle] = []
        self._gradients: _GradientLedger | None = None
        self._segment_state: tuple[int, int] = (0, 0)
        self._awaiting_forward = False
        self._recomputation: _Recomputation | None = None
        self._recomputed_finalizers: list[weakref.finalize[Any, Any]] = []
        self._phase = Phase.FORWARD
        self._phases: dict[Phase, Breakdown] = {}
        self.error: Exception | None = None
        """The first error raised inside the hooks; from then on they pass everything through untouched."""

    def _note_uncounted(self, kinds: Iterable[str]) -> None:
        for kind in kinds:
            what = f"{kind} tensors"
            if what not in self.notes:
                self.notes[what] = NotMeasured(
                    what, "their data has no storage the monitor can read: left out of the tensor counts"
                )

    def _refresh_parameters(self) -> None:
        """Read the parameters' storages again while some are uninitialised (lazy modules materialise later)."""
        if self._lazy_parameters:
            self._parameters = parameter_storages(self._module, self._device)
            self._note_uncounted(self._parameters.uncounted)
            self._lazy_parameters = any(is_lazy(parameter) for parameter in self._module.parameters())

    def _model_state(self) -> tuple[int, int]:
        """(gradient bytes, optimizer-state bytes) alive now."""
        self._refresh_parameters()
        _, gradients, state = model_state_storages(self._module, self._optimizers, self._device)
        self._note_uncounted(gradients.uncounted | state.uncounted)
        return sum(gradients.values()), sum(state.values())

    def begin_forward(self, batch: Any = None) -> None:
        """Watch saved tensors and module calls until ``finish``; the state alive is counted at the first module call.

        Backward passes and optimizer updates (under ``no_grad``) save nothing, so the hooks can stay for the
        whole step and see every forward pass of it, as in a GAN's manual optimization.
        """
        self._segment_state = self._model_state()  # kept if no module is called before the next boundary
        self._awaiting_forward = True
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
        def enter(_module: nn.Module, args: Any) -> None:
            if self.error is not None:
                return
            try:
                if running_backward(default=self._phase is Phase.BACKWARD):
                    enter_recomputation()
                else:
                    count(args)
            except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
                self.error = error

        def enter_recomputation() -> None:
            if self._recomputation is None:
                self._recomputation = _Recomputation(len(self._module_stack), self._on_recomputed)
            self._module_stack.append(label)

        def count(args: Any) -> None:
            if self._awaiting_forward:  # the first module call of a forward pass: the state it really runs with
                self._awaiting_forward = False
                self._segment_state = self._model_state()
            counter = self._counters.get(label)
            if counter is None:
                counter = self._counters[label] = ModuleTally()
            inputs = storage_bytes(args, self._device)
            self._note_uncounted(inputs.uncounted)
            counter.input_bytes += sum(inputs.values())
            if any(self._ledger.holds(key) for key in inputs):
                counter.input_saved_for_backward = True
            self._observer.enter(label, self._modules[label], args, inputs)
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
        if not self._module_stack:
            return
        label = self._module_stack.pop()
        recomputation = self._recomputation
        if recomputation is not None:
            if len(self._module_stack) <= recomputation.depth:  # the recomputed module's forward ended
                self._recomputation = None
                recomputation.end()
                if self._gradients is not None:
                    self._gradients.observe()
            return
        outputs = storage_bytes(output, self._device)
        counter = self._counters.get(label)
        if counter is not None:
            counter.output_bytes += sum(outputs.values())
        module = self._modules[label]
        self._observer.leave(label, module, output, outputs, isinstance(stored_attribute(module, "inplace"), bool))

    def _on_recomputed(self, output: Any) -> None:
        """An operator of a recomputation created ``output``: hold its new storages until they are freed."""
        if self.error is not None or self._recomputation is None:
            return
        try:
            for tensor in iter_tensors(output):
                self._hold_recomputed(tensor)
        except Exception as error:  # noqa: BLE001 -- inside the user's backward: report, never raise
            self.error = error

    def _hold_recomputed(self, tensor: Tensor) -> None:
        local = local_tensor(tensor)
        if not on_device(local, self._device):
            return
        found = tensor_storages(local)
        if found is None:
            self._note_uncounted([tensor_kind(local)])
            return
        for storage in found:
            key = storage.data_ptr()
            if key and key not in self._parameters and self._ledger.hold_recomputed(key, storage.nbytes()):
                self._recomputed_finalizers.append(weakref.finalize(storage, self._ledger.free_recomputed, key))

    def _pack(self, tensor: Tensor) -> Any:
        if self.error is not None:
            return without_history(tensor)
        try:
            return self._pack_counted(tensor)
        except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
            self.error = error
            return without_history(tensor)

    def _pack_counted(self, tensor: Tensor) -> Any:
        if parameter_partition(tensor) is not None:
            return tensor  # a ZeRO-3 parameter, gathered for this layer: DeepSpeed frees it and gathers it again
        local = local_tensor(tensor)
        if not on_device(local, self._device):
            return without_history(tensor)
        found = tensor_storages(local)
        if found is None:
            self._note_uncounted([tensor_kind(local)])
            return without_history(tensor)
        self._refresh_parameters()
        keys = [(storage.data_ptr(), storage.nbytes()) for storage in found]
        keys = [(key, nbytes) for key, nbytes in keys if key and key not in self._parameters]
        if not keys:
            return without_history(tensor)
        owner: str | None = self._module_stack[-1] if self._module_stack else OUTSIDE_MODULES
        if running_backward(default=self._recomputation is not None):
            owner = None  # saved by a recomputation in backward, not by the forward pass
        for key, nbytes in keys:
            self._ledger.acquire(key, nbytes, owner)
            self._observer.saved(key)
        return _SavedActivation(tensor, self._ledger, tuple(key for key, _ in keys))

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _SavedActivation) else packed

    def before_backward(self) -> None:
        """A backward pass starts: what ran since the last boundary was a forward pass."""
        self._observer.forward_ended(self._ledger.holds)
        self._close_segment(Phase.FORWARD)
        self._phase = Phase.BACKWARD
        self._gradients = _GradientLedger(self._module, self._optimizers, self._ledger, self._device)
        if not self._gradient_handles:
            for parameter in self._module.parameters():
                if parameter.requires_grad and not is_lazy(parameter):
                    # torch ships this method without annotations.
                    handle = parameter.register_post_accumulate_grad_hook(self._on_gradient)  # type: ignore[no-untyped-call]
                    self._gradient_handles.append(handle)

    def _on_gradient(self, parameter: Tensor) -> None:
        if self.error is not None or self._gradients is None or parameter.grad is None:
            return
        try:
            self._gradients.add(parameter, parameter.grad)
        except Exception as error:  # noqa: BLE001 -- inside the user's backward: report, never raise
            self.error = error

    def before_optimizer_step(self) -> None:
        """An optimizer is about to step: close the segment that ran since the last boundary."""
        self._close_segment(self._phase)
        self._phase = Phase.OPTIMIZER
        self._awaiting_forward = True  # manual optimization may run another forward pass next

    def finish(self) -> Attribution:
        """Close the step's last segment, remove every hook, and return the counts."""
        self._close_segment(self._phase)
        self.close()
        return Attribution(
            step=self._step, phases=dict(self._phases), modules=self._module_profiles(), batch_size=self._batch_size
        )

    def _close_segment(self, phase: Phase) -> None:
        """Count the segment that ends now as ``phase``; a phase met twice in a step keeps its highest count."""
        now = self._model_state()
        gradients = self._gradients
        if gradients is not None:
            self._note_uncounted(gradients.uncounted)
        backward_peak = (gradients.gradients_at_peak, gradients.activations_at_peak) if gradients else None
        parameter_bytes = sum(self._parameters.values())
        counted = phase_breakdown(phase, parameter_bytes, self._segment_state, now, self._ledger, backward_peak)
        known = self._phases.get(phase)
        if known is None or counted.counted_bytes > known.counted_bytes:
            self._phases[phase] = counted
        self._gradients = None
        self._segment_state = now
        self._awaiting_forward = False
        self._ledger.start_segment()

    def _module_profiles(self) -> tuple[ModuleProfile, ...]:
        """Every module called during the forward pass, in registration order, then code outside modules."""
        saved = self._ledger.saved_bytes_by_module
        profiles = []
        for label, counter in self._counters.items():
            module = self._modules[label]
            profiles.append(module_profile(label, module, saved.get(label, 0), counter, self._observer.facts(label)))
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
        recomputation, self._recomputation = self._recomputation, None
        if recomputation is not None:
            recomputation.end()
        for finalizer in self._recomputed_finalizers:
            finalizer.detach()
        self._recomputed_finalizers.clear()
        for handle in (*self._handles, *self._gradient_handles):
            handle.remove()
        self._handles.clear()
        self._gradient_handles.clear()
        self._module_stack.clear()
        self._gradients = None
