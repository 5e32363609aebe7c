"""Counting one training step tensor by tensor: parameters, gradients, optimizer state, activations, per phase.

One counter, :class:`StepAttributor`, counts sampled steps of the real training and steps replayed under fake
tensors. Both tell storages apart by their ``StorageWeakRef`` identities (which fake storages have too, and which no
later allocation takes while the storage lives); a :class:`Counting` says what differs between the two: who shows it
what a recomputation creates, and whether errors inside its hooks are contained (the user's training) or raised (a
replay). Storages are counted by
:mod:`~lightning_vram.measure.storages`, live bytes by :mod:`~lightning_vram.measure.ledgers`, and phases and
modules add up in :mod:`~lightning_vram.measure.tallies`. Activations are the tensors autograd saves for backward,
seen through ``torch.autograd.graph.saved_tensors_hooks``, and the op outputs torch's selective checkpointing keeps
from forward for its recomputation (outside those hooks: read from its forward's dispatch mode).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from lightning_vram.measure._recompute import (
    Recomputation,
    backward_node,
    kept_outputs,
    running_backward,
    selective_forward,
    selective_recomputation,
)
from lightning_vram.measure.compiled import compiled_in_place, compiled_module_names
from lightning_vram.measure.counting import SAMPLED, Counting
from lightning_vram.measure.deepspeed_zero import parameter_partition
from lightning_vram.measure.fsdp1 import GatheredFlatParameters
from lightning_vram.measure.ledgers import ActivationLedger, GradientLedger, SavedActivation, SavedTensor
from lightning_vram.measure.live import apart_from_function_modes
from lightning_vram.measure.module_names import user_named_modules
from lightning_vram.measure.observations import ModuleObserver, stored_attribute
from lightning_vram.measure.scripted import hook_forward, scripted_module_names, scripted_note
from lightning_vram.measure.storages import (
    StorageBytes,
    local_tensor,
    model_state_storages,
    on_device,
    parameter_storages,
    storage_bytes,
    tensor_kind,
    tensor_storages,
    unsharded_parameters,
    weak_identity,
)
from lightning_vram.measure.tallies import OUTSIDE_MODULES, ROOT_MODULE, ModuleTally, module_profiles, phase_breakdown
from lightning_vram.measure.tensors import batch_size_of, iter_tensors, time_major
from lightning_vram.records import Attribution, Breakdown, NotMeasured, Phase


class StepAttributor:
    """Counts one training step (sampled, or replayed: see ``counting``), phase by phase, tensor by tensor.

    Call ``begin_forward`` at batch start, ``before_backward`` and ``before_optimizer_step`` at those hooks
    (as often as they come: manual optimization may run several of each), optionally ``after_backward`` and
    ``after_optimizer_step`` where a backward pass or an update returns, and ``finish`` at batch end; ``close``
    removes every hook and is safe at any time. Each boundary ends a segment: one that ends at a backward is a
    forward pass; one that begins at a backward is the backward pass (until ``after_backward``, or the next
    boundary without it); one that begins at an optimizer step is the optimizer phase (until
    ``after_optimizer_step``, or the next boundary or the step's end without it); any other, the code after a
    backward or an update that no backward follows, counts with the phase before it. A phase met twice in a step
    keeps its highest count. The counted peak of each phase is:

    - forward: parameters + gradients alive when the forward pass began (at its first module call, which
      is after the LightningModule's own ``on_train_batch_start``: the previous step's gradients, unless
      freed) + optimizer state + the highest live bytes of saved activations in the segment;
    - backward: parameters + optimizer state + the highest sum of live activations and gradients
      while backward frees one and creates the other; a module's forward re-run during backward by
      activation checkpointing adds what it creates and still holds when it ends (and the modules it re-ran are
      listed, unit by unit, in the attribution's ``recomputed_units``, those torch's selective checkpointing re-ran
      in its ``selective_units``);
    - optimizer: parameters + gradients alive when it began (or after, if more) + optimizer state after the
      update + activations still held.

    Parameters are this rank's shards, plus under FSDP2 the whole parameters gathered at that phase's counted peak
    (the module's registered parameters while it runs unsharded): parameters even where autograd saves them, never
    activations or a module's saving. FSDP1's gathered flat parameters (:mod:`~lightning_vram.measure.fsdp1`) are
    not activations either, though autograd saves views of them: FSDP1 frees them by ``resize_(0)`` after the unit's
    forward and gathers them again for its backward, so autograd's saving holds none of their bytes; they are
    FSDP1's all-gather output, left to the live peak's ``other`` with the strategy's other buffers (the same figure
    every run, where counting each at its gathered size varied with the addresses the allocator reused). Gradients
    are read from the parameters as the step began (FSDP2's shards).

    Uninitialised parameters count once materialised; tensors whose data cannot be reached are skipped and
    listed in ``notes``. ``counting`` says who watches recomputation and how the hooks behave (:data:`SAMPLED`,
    or the replay's); ``on_saved(key, nbytes)`` hears of each storage autograd starts to hold for backward.
    """

    def __init__(
        self,
        step: int,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        device: torch.device,
        notes: dict[str, NotMeasured] | None = None,
        counting: Counting = SAMPLED,
        on_saved: Callable[[int, int], None] | None = None,
    ):
        self._step = step
        self._module = module
        self._optimizers = optimizers
        self._device = device
        self._counting = counting
        self._on_saved = on_saved
        self.notes: dict[str, NotMeasured] = notes if notes is not None else {}
        """What the counting skipped and why, by what; shared with the caller when it passes its own dict."""
        self._lazy_parameters = True
        self._parameters = StorageBytes()
        self._parameter_bytes = 0
        self._parameter_tensors: tuple[Tensor, ...] = ()
        """The module's parameters as the step begins: FSDP2's sharded ones, which hold the gradients while the
        module shows its unsharded ones."""
        self._refresh_parameters()
        self._ledger = ActivationLedger()
        self._fsdp1_gathered = GatheredFlatParameters(module)
        self._module_stack: list[str] = []
        self._modules = {name or ROOT_MODULE: child for name, child in user_named_modules(module).items()}
        self.compiled = compiled_module_names(module)
        """Modules run by torch.compile: their saved tensors are counted, charged to the module as a whole."""
        self.scripted = scripted_module_names(self._modules)
        """TorchScript modules (outermost): each counted as one unit, its saved tensors charged to it as a whole."""
        if self.scripted:
            self.notes.setdefault("scripted", scripted_note(self.scripted))
        self._counters: dict[str, ModuleTally] = {}
        self._observer = ModuleObserver(weak_identity)
        self._batch_size: int | None = None
        self._handles: list[RemovableHandle] = []
        self._saved_tensors_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._gradient_handles: list[RemovableHandle] = []
        self._gradients: GradientLedger | None = None
        self._segment_state: tuple[int, int] = (0, 0)
        self._awaiting_forward = False
        self._recomputation: Recomputation | None = None
        self._held_finalizers: list[weakref.finalize[Any, Any]] = []
        """One per storage held until freed: a recomputation's, or one selective checkpointing keeps."""
        self._keeping: list[tuple[weakref.ref[Any], int, str]] = []
        """Selective checkpointing's forward modes met this step (weakly: the monitor keeps none of them alive), each
        with the module stack's length outside the outermost modules it runs and the first of those modules."""
        self._recomputed_units: list[list[str]] = []
        """The outermost modules each recomputation re-ran in backward, unit by unit, in the order they ran."""
        self._selective_units: list[str] = []
        """The first module of each of those units torch's selective checkpointing re-ran."""
        self._recomputing_node: int | None = None
        """The autograd node (its sequence number) whose backward ran the last recomputation."""
        self._phase = Phase.FORWARD
        self._phases: dict[Phase, Breakdown] = {}
        self.error: Exception | None = None
        """The first error raised inside the hooks; from then on they pass everything through untouched."""

    def _failed(self, error: Exception) -> None:
        """An error inside a hook: raised where ``counting`` says so, else kept while the hooks stand aside."""
        if self._counting.raise_errors:
            raise error
        self.error = error

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
            self._parameter_tensors = tuple(self._module.parameters())
            self._parameters = parameter_storages(self._module, self._device, weak_identity)
            self._parameter_bytes = sum(self._parameters.values())
            self._note_uncounted(self._parameters.uncounted)
            self._lazy_parameters = any(is_lazy(parameter) for parameter in self._module.parameters())

    def _model_state(self) -> tuple[int, int]:
        """(gradient bytes, optimizer-state bytes) alive now."""
        self._refresh_parameters()
        _, gradients, state = model_state_storages(
            self._module, self._optimizers, self._device, weak_identity, self._parameter_tensors
        )
        self._note_uncounted(gradients.uncounted | state.uncounted)
        return sum(gradients.values()), sum(state.values())

    @property
    def current_module(self) -> str | None:
        """The module whose forward runs now (the innermost; ``None`` outside any, as in most of backward)."""
        return self._module_stack[-1] if self._module_stack else None

    def live_parts(self) -> tuple[int, int, int, int]:
        """(parameters, gradients, optimizer state, activations) alive now, in bytes, from what is kept anyway.

        Cheap enough to read after every op: parameters (this rank's shards), the optimizer state as the segment
        began, the gradients as the segment began or, during backward, as the gradient ledger last saw them, and
        the activations autograd holds now (FSDP2's gathered parameters are left to the caller's remainder).
        """
        gradients = self._gradients.gradient_bytes if self._gradients is not None else self._segment_state[0]
        return self._parameter_bytes, gradients, self._segment_state[1], self._ledger.live_bytes

    def begin_forward(self, batch: Any = None) -> None:
        """Watch saved tensors and module calls until ``finish``; the state alive is counted at the first module call.

        Backward passes and optimizer updates (under ``no_grad``) save nothing, so the hooks can stay for the
        whole step and see every forward pass of it, as in a GAN's manual optimization.
        """
        self._segment_state = self._model_state()  # kept if no module is called before the next boundary
        self._awaiting_forward = True
        self._batch_size = None if time_major(batch) is not None else batch_size_of(batch)  # (L, B): no batch known
        for label, child in self._modules.items():
            if compiled_in_place(child) or any(label.startswith(f"{outer}.") for outer in self.compiled):
                continue  # inside a compiled graph the hooks would not fire, and adding them forces recompiles
            if any(label.startswith(f"{outer}.") for outer in self.scripted):
                continue  # inside TorchScript no Python hook runs (and a scripted module refuses to be given one)
            self._handles += hook_forward(child, self._make_enter(label), self._leave)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._saved_tensors_hooks = hooks

    def _make_enter(self, label: str) -> Any:
        @apart_from_function_modes
        def enter(_module: nn.Module, args: Any) -> None:
            if self.error is not None:
                return
            try:
                if running_backward(default=self._phase is Phase.BACKWARD):
                    enter_recomputation()
                else:
                    count(args)
            except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
                self._failed(error)

        def enter_recomputation() -> None:
            if self._recomputation is None:
                watched = self.on_output if self._counting.watch_recomputation else None  # else the caller's
                self._recomputation = Recomputation(len(self._module_stack), watched)
                self._note_recomputed(label)
            self._module_stack.append(label)

        def count(args: Any) -> None:
            self._watch_unsharded(self._modules[label])
            if self._awaiting_forward:  # the first module call of a forward pass: the state it really runs with
                self._awaiting_forward = False
                self._segment_state = self._model_state()
            counter = self._counters.get(label)
            if counter is None:
                counter = self._counters[label] = ModuleTally()
            self._watch_keeping(label)
            inputs = storage_bytes(args, self._device, weak_identity)
            self._note_uncounted(inputs.uncounted)
            counter.calls += 1
            counter.input_bytes += sum(inputs.values())
            if any(self._ledger.holds(key) for key in inputs):
                counter.input_saved_for_backward = True
            self._observer.enter(label, self._modules[label], args, inputs)
            self._module_stack.append(label)

        return enter

    def _note_recomputed(self, label: str) -> None:
        """Module ``label`` is re-run in backward, outside any other recomputed module.

        It joins the unit the same autograd node is recomputing, or starts the next unit (each module its own unit
        where torch cannot tell the nodes apart), noted as selective where torch's selective checkpointing re-runs it.
        """
        node = backward_node()
        if self._recomputed_units and node is not None and node == self._recomputing_node:
            self._recomputed_units[-1].append(label)
        else:
            self._recomputed_units.append([label])
            if selective_recomputation():
                self._selective_units.append(label)
        self._recomputing_node = node

    def _watch_keeping(self, label: str) -> None:
        """Module ``label``'s forward starts: note the selective checkpointing forward it runs in, if any and new."""
        mode = selective_forward()
        if mode is not None and not any(known() is mode for known, _, _ in self._keeping):
            self._keeping.append((weakref.ref(mode), len(self._module_stack), label))

    def _hold_kept(self) -> None:
        """Hold what selective checkpointing keeps from forward until it is freed, as its region's first module saves.

        Called as each module ends: where it is one of the outermost modules of a selectively checkpointed region,
        every op output the region's forward keeps now (those held already stay). An op the region runs after its
        last module (outside any) keeps its output unseen here: torch drops its forward's mode as the region ends,
        and the output counts once backward's recomputation reads it back.
        """
        depth = len(self._module_stack)
        alive = []
        for known, top, first in self._keeping:
            mode = known()
            if mode is None:
                continue
            alive.append((known, top, first))
            if depth == top:
                for tensor in kept_outputs(mode):
                    self._hold_until_freed(tensor, first)
        self._keeping = alive

    def _watch_unsharded(self, module: nn.Module) -> None:
        """FSDP2 gathered ``module``'s parameters before this call: parameters, never its activations."""
        for parameter in unsharded_parameters(module):
            self._ledger.unsharded.hold(parameter)
        self._ledger.observe_unsharded()

    @apart_from_function_modes
    def _leave(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self.error is not None:
            return
        try:
            self._ledger.observe_unsharded()
            self._count_output(output)
        except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
            self._failed(error)

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
        outputs = storage_bytes(output, self._device, weak_identity)
        counter = self._counters.get(label)
        if counter is not None:
            counter.output_bytes += sum(outputs.values())
        module = self._modules[label]
        self._observer.leave(label, module, output, outputs, isinstance(stored_attribute(module, "inplace"), bool))
        if self._keeping:
            self._hold_kept()

    def on_output(self, output: Any) -> None:
        """An operator created ``output``: during a recomputation, hold its new storages until they are freed."""
        if self.error is not None or self._recomputation is None:
            return
        try:
            for tensor in iter_tensors(output):
                self._hold_until_freed(tensor, None)
        except Exception as error:  # noqa: BLE001 -- inside the user's backward: report, never raise
            self._failed(error)

    def _storages(self, tensor: Tensor) -> list[torch.UntypedStorage]:
        """The storages of ``tensor`` (its local shard) on the device: none where elsewhere or unreachable (noted)."""
        local = local_tensor(tensor)
        if not on_device(local, self._device):
            return []
        found = tensor_storages(local)
        if found is None:
            self._note_uncounted([tensor_kind(local)])
            return []
        return found

    def _hold_until_freed(self, tensor: Tensor, owner: str | None) -> None:
        """Count ``tensor``'s storages as activations until freed, as ``owner``'s saving (``None``: no module's)."""
        for storage in self._storages(tensor):
            key = weak_identity(storage)
            if self._gathered(storage):
                continue  # a parameter FSDP1 or FSDP2 gathered again for backward
            if key and key not in self._parameters and self._ledger.hold_until_freed(key, storage.nbytes(), owner):
                self._held_finalizers.append(weakref.finalize(storage, self._ledger.free_held, key))

    def _gathered(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` holds parameters FSDP1 or FSDP2 gathered: never activations.

        FSDP2's count as parameters, FSDP1's are left to ``other``.
        """
        return self._ledger.unsharded.holds(storage) or self._fsdp1_gathered.holds(storage)

    @apart_from_function_modes
    def _pack(self, tensor: Tensor) -> Any:
        if self.error is not None:
            return SavedTensor(tensor)
        try:
            return self._pack_counted(tensor)
        except Exception as error:  # noqa: BLE001 -- inside the user's forward: report, never raise
            self._failed(error)
            return SavedTensor(tensor)

    def _pack_counted(self, tensor: Tensor) -> Any:
        if parameter_partition(tensor) is not None:
            return tensor  # a ZeRO-3 parameter, gathered for this layer: DeepSpeed frees it and gathers it again
        found = [storage for storage in self._storages(tensor) if not self._gathered(storage)]
        self._refresh_parameters()
        keys = [(weak_identity(storage), storage.nbytes()) for storage in found]
        keys = [(key, nbytes) for key, nbytes in keys if key and key not in self._parameters]
        if not keys:
            return SavedTensor(tensor)
        owner: str | None = self._module_stack[-1] if self._module_stack else OUTSIDE_MODULES
        if running_backward(default=self._recomputation is not None):
            owner = None  # saved by a recomputation in backward, not by the forward pass
        for key, nbytes in keys:
            if self._on_saved is not None and not self._ledger.holds(key):
                self._on_saved(key, nbytes)
            self._ledger.acquire(key, nbytes, owner)
            self._observer.saved(key)
        return SavedActivation(tensor, self._ledger, tuple(key for key, _ in keys))

    @apart_from_function_modes
    def _unpack(self, packed: Any) -> Tensor:
        if self.error is None and self._ledger.unsharded.watching:
            try:  # FSDP2 gathered the parameters again for the backward that reads this: a moment to count
                self._ledger.observe_unsharded()
                if self._gradients is not None:
                    self._gradients.observe()
            except Exception as error:  # noqa: BLE001 -- inside the user's backward: report, never raise
                self._failed(error)
        unpacked: Tensor = packed.unpack() if isinstance(packed, SavedTensor) else packed
        return unpacked

    def before_backward(self) -> None:
        """A backward pass starts: what ran since the last boundary was a forward pass."""
        self._observer.forward_ended(self._ledger.holds)
        self._close_segment(Phase.FORWARD)
        self._phase = Phase.BACKWARD
        self._gradients = GradientLedger(
            self._module, self._optimizers, self._ledger, self._device, weak_identity, self._parameter_tensors
        )
        if not self._gradient_handles:
            for parameter in self._parameter_tensors or tuple(self._module.parameters()):
                if parameter.requires_grad and not is_lazy(parameter):
                    # torch ships this method without annotations.
                    handle = parameter.register_post_accumulate_grad_hook(self._on_gradient)  # type: ignore[no-untyped-call]
                    self._gradient_handles.append(handle)

    @apart_from_function_modes
    def _on_gradient(self, parameter: Tensor) -> None:
        if self.error is not None or self._gradients is None or parameter.grad is None:
            return
        try:
            self._ledger.observe_unsharded()
            self._gradients.add(parameter, parameter.grad)
        except Exception as error:  # noqa: BLE001 -- inside the user's backward: report, never raise
            self._failed(error)

    def before_optimizer_step(self) -> None:
        """An optimizer is about to step: close the segment that ran since the last boundary."""
        self._close_segment(self._phase)
        self._phase = Phase.OPTIMIZER
        self._awaiting_forward = True  # manual optimization may run another forward pass next

    def after_backward(self) -> None:
        """A backward pass returned: close its segment; what runs next may be another forward pass."""
        self._close_segment(Phase.BACKWARD)
        self._awaiting_forward = True

    def after_optimizer_step(self) -> None:
        """An optimizer's update returned: close its segment; what runs next may be another forward pass."""
        self._close_segment(Phase.OPTIMIZER)
        self._awaiting_forward = True

    def finish(self) -> Attribution:
        """Close the step's last segment, remove every hook, and return the counts."""
        self._close_segment(self._phase)
        self.close()
        return Attribution(
            step=self._step,
            phases=dict(self._phases),
            modules=module_profiles(self._modules, self._counters, self._ledger.saved_bytes_by_module, self._observer),
            batch_size=self._batch_size,
            recomputed_units=tuple(tuple(unit) for unit in self._recomputed_units),
            selective_units=tuple(self._selective_units),
        )

    def _close_segment(self, phase: Phase) -> None:
        """Count the segment that ends now as ``phase``; a phase met twice in a step keeps its highest count."""
        now = self._model_state()
        gradients = self._gradients
        if gradients is not None:
            self._note_uncounted(gradients.uncounted)
        backward_peak = (gradients.gradients_at_peak, gradients.activations_at_peak) if gradients else None
        self._ledger.observe_unsharded()
        parameter_bytes = sum(self._parameters.values()) + self._unsharded_bytes(phase)
        counted = phase_breakdown(phase, parameter_bytes, self._segment_state, now, self._ledger, backward_peak)
        known = self._phases.get(phase)
        if known is None or counted.counted_bytes > known.counted_bytes:
            self._phases[phase] = counted
        self._gradients = None
        self._segment_state = now
        self._awaiting_forward = False
        self._ledger.start_segment()

    def _unsharded_bytes(self, phase: Phase) -> int:
        """FSDP2's unsharded parameters alive at ``phase``'s counted peak (at its end for an optimizer step)."""
        if phase is Phase.BACKWARD and self._gradients is not None:
            return self._gradients.transient_at_peak
        return self._ledger.transient_at_peak if phase is Phase.FORWARD else self._ledger.transient_bytes

    def close(self) -> None:
        """Remove every hook this step installed. Safe to call at any point, more than once."""
        hooks, self._saved_tensors_hooks = self._saved_tensors_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        recomputation, self._recomputation = self._recomputation, None
        if recomputation is not None:
            recomputation.end()
        for finalizer in self._held_finalizers:
            finalizer.detach()
        self._held_finalizers.clear()
        self._keeping.clear()
        self._recomputing_node = None
        for handle in (*self._handles, *self._gradient_handles):
            handle.remove()
        self._handles.clear()
        self._gradient_handles.clear()
        self._module_stack.clear()
        self._gradients = None
        self._ledger.unsharded.clear()
