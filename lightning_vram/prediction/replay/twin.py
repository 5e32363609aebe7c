"""The replay's own copy of the training state, made of fake tensors: module, gradients, optimizers, batch.

The module is deep-copied under :class:`~torch._subclasses.fake_tensor.FakeCopyMode`: every tensor it holds becomes
a fake one of the same shape, dtype and device (a LightningModule's copy drops its Trainer, as its pickling does,
but for its rank under several processes: :class:`RanksOnly`; its ``log`` and ``log_dict`` do nothing, and its
``lr_schedulers()`` gives stand-ins whose ``step`` does nothing: :func:`~.manual.replay_schedulers`). NumPy
arrays the module or the batch hold are shared, not copied (a 400 MB table would be copied on every replay): the
replay makes them read-only while it runs. The batch is deep-copied the same way, plain objects and dataclasses
included, so that a ``training_step`` that sets ``batch.x`` sets it on the copy. Neither copy runs a copy hook of the
user's (a ``__getstate__``, ``__setstate__`` or ``__deepcopy__``, which may change the real object or the process):
:mod:`~lightning_vram.prediction.replay.hook_free`. Gradients are faked from the real ones (not a DTensor's shard: an
FSDP2 rank's replay warms up its own); optimizers come from :mod:`~lightning_vram.prediction.replay.optimizers`, on
the path the real run takes (:mod:`~lightning_vram.prediction.replay.optimizer_path`).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_vram.measure.scripted import scripted_module_names, scripted_tensors
from lightning_vram.measure.storages import DTENSOR, local_tensor, storage_key
from lightning_vram.measure.tensors import iter_tensors
from lightning_vram.prediction.replay._fake import FakeCopyMode, FakeTensor, FakeTensorMode
from lightning_vram.prediction.replay.hook_free import without_user_hooks
from lightning_vram.prediction.replay.manual import replay_schedulers
from lightning_vram.prediction.replay.optimizer_path import follow_real_path
from lightning_vram.prediction.replay.optimizers import configured_optimizers, rebuild_optimizer
from lightning_vram.prediction.replay.unsharded import Unsharding, is_flat_parameter, sharded_live

_ARRAY_DEPTH = 3
"""How deep into attributes, lists and dicts :func:`shared_arrays` and :func:`generator_copies` look."""


@dataclass
class Twin:
    """The fake copy one replay runs on."""

    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    batch: Any
    batch_tensors: list[Tensor]
    batch_values: list[tuple[Tensor, Tensor]]
    """Each fake tensor of the batch copy with the real tensor it copies (whose value the replay may read)."""


class RanksOnly:
    """Stands in for a LightningModule's Trainer in a replay's copy under several processes: the rank it runs on.

    ``global_rank``, ``local_rank``, ``node_rank``, ``world_size``, ``global_step`` and ``current_epoch`` as the
    Trainer had them when the copy was made (plain integers), so that a step that reads its rank (``self.global_rank``)
    replays this rank's step; anything else raises as a module without a Trainer does (the replay is skipped saying
    the step reads ``self.trainer``). One process keeps the copy without a Trainer, as before.
    """

    FACTS = ("global_rank", "local_rank", "node_rank", "world_size", "global_step", "current_epoch")

    def __init__(self, facts: dict[str, int]) -> None:
        self.__dict__.update(facts)

    @classmethod
    def of(cls, trainer: Any) -> RanksOnly | None:
        """The stand-in for ``trainer`` where it trains on several processes; ``None`` otherwise (or without one)."""
        world_size = getattr(trainer, "world_size", 1)
        if not isinstance(world_size, int) or world_size <= 1:
            return None
        facts = {name: getattr(trainer, name, 0) for name in cls.FACTS}
        return cls({name: value for name, value in facts.items() if isinstance(value, int)})

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the replay's copy is not attached to a `Trainer` (it knows the rank, not Trainer.{name})")


def _no_logging(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for ``self.log`` and ``self.log_dict`` during a replay: nothing is logged."""


def shared_arrays(value: Any) -> list[Any]:
    """The NumPy arrays a module's submodules (or a batch) hold, as attributes or in lists, tuples and dicts."""
    numpy = sys.modules.get("numpy")
    return [] if numpy is None else _held(value, numpy.ndarray)


def generator_copies(module: nn.Module) -> dict[int, torch.Generator]:
    """A copy of each ``torch.Generator`` the module's submodules hold, by the generator's ``id``, in the same state.

    A generator does not deep-copy under the fake copy mode (its state would be a fake tensor); the replay's copy of
    the module holds these instead, so what the replay draws leaves the user's generators as they were. Reading a
    generator's state reads the host's copy of it (a CUDA generator's seed and offset): no device sync.
    """
    copies: dict[int, torch.Generator] = {}
    for generator in _held(module, torch.Generator):
        copied = torch.Generator(device=generator.device)
        copied.set_state(generator.get_state())
        copies[id(generator)] = copied
    return copies


def _held(value: Any, kind: type) -> list[Any]:
    """The ``kind`` objects a module's submodules (or a batch) hold, as attributes or in lists, tuples and dicts."""
    found: dict[int, Any] = {}
    pending = [vars(child) for child in value.modules()] if isinstance(value, nn.Module) else [value]
    for _ in range(_ARRAY_DEPTH):
        nested: list[Any] = []
        for item in pending:
            if isinstance(item, kind):
                found[id(item)] = item
            elif isinstance(item, dict):
                nested += item.values()
            elif isinstance(item, (list, tuple)):
                nested += item
            elif hasattr(item, "__dict__") and not isinstance(item, (nn.Module, Tensor, type)):
                nested += vars(item).values()
        pending = nested
    return list(found.values())


Substitutes = dict[int, Any]
"""What the copies hold instead of an object, by the object's ``id``: itself (shared), or a stand-in."""


def fake_module(module: nn.Module, mode: FakeTensorMode, substitutes: Substitutes) -> tuple[nn.Module, dict[int, Any]]:
    """A deep copy of ``module`` with fake tensors, and the copy's memo (real object ``id`` -> its copy).

    The objects in ``substitutes`` are not copied: the copy holds their substitutes. A module sharded by FSDP2's
    ``fully_shard``, FSDP1's ``FullyShardedDataParallel`` or DeepSpeed's ZeRO-3 is copied unsharded
    (:class:`~lightning_vram.prediction.replay.unsharded.Unsharding`).
    """
    memo: dict[int, Any] = {**generator_copies(module), **substitutes}
    fabric = getattr(module, "fabric", None)
    if fabric is not None:
        memo[id(fabric)] = None
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        # Copied as None, as LightningModule's __getstate__ copies it; an FSDP2 unit's attributes are copied past
        # that hook (Unsharding.fill): the printed configure_model's fully_shard(self) reached the Trainer's locks.
        memo[id(trainer)] = None
    sharded = sharded_live(module)
    if not sharded:
        _fake_parameters(module, mode, memo)
    with FakeCopyMode(mode), without_user_hooks():
        unsharding = Unsharding(module, mode) if sharded else None
        if unsharding is not None:
            unsharding.fill(memo)
        copied = copy.deepcopy(module, memo)
        if unsharding is not None:
            unsharding.finish(memo)
        for name in scripted_module_names(dict(module.named_modules())):
            _fake_scripted(module.get_submodule(name), copied.get_submodule(name), memo)
    trainer = getattr(module, "_trainer", None)
    ranks = RanksOnly.of(trainer)
    schedulers = replay_schedulers(trainer)
    if schedulers is not None and callable(getattr(copied, "lr_schedulers", None)):
        vars(copied)["lr_schedulers"] = schedulers  # an instance attribute of the copy only
    for child in copied.modules():
        if ranks is not None and "_trainer" in vars(child):
            vars(child)["_trainer"] = ranks  # an instance attribute of the copy only
        if callable(getattr(child, "log", None)):
            child.log = _no_logging  # type: ignore[assignment]  # an instance attribute of the copy only
        if callable(getattr(child, "log_dict", None)):
            child.log_dict = _no_logging  # type: ignore[assignment]  # an instance attribute of the copy only
    return copied, memo


def _fake_parameters(module: nn.Module, mode: FakeTensorMode, memo: dict[int, Any]) -> None:
    """Put in ``memo`` the fake copy of each of the module's plain contiguous parameters, made by one fake op.

    ``Parameter.__deepcopy__`` under the fake copy mode converts a view of the parameter (the converter's fake of its
    storage, which any other tensor of that storage converted later shares), clones it and detaches the clone: three
    steps, two of them ops through the fake mode (about 0.4 ms of a parameter's 0.5 ms). Its result is a tensor of
    the parameter's shape, dtype and device, contiguous, on a storage of its own, a leaf parameter with the real
    one's ``requires_grad``: ``torch.empty_strided`` under the fake mode makes that tensor at once, and the
    converter never sees the real storage (a handle on the parameter's data, or the flat tensor it views, is faked
    as before: on a storage apart from the copy's). An ``nn.Parameter`` (not a subclass: a lazy module's
    uninitialised one, a library's own) on the CPU or a GPU, dense and contiguous, is made so; any other parameter,
    or one ``memo`` holds already, is copied by ``deepcopy``.
    """
    for parameter in module.parameters():
        if (
            type(parameter) is not nn.Parameter
            or id(parameter) in memo
            or parameter.device.type not in ("cpu", "cuda")
            or parameter.layout != torch.strided
            or parameter.is_quantized
            or not parameter.is_contiguous()
        ):
            continue
        with mode:
            fake = torch.empty_strided(
                parameter.shape, parameter.stride(), dtype=parameter.dtype, device=parameter.device
            )
        fake.requires_grad_(parameter.requires_grad)
        fake._is_param = True  # what nn.Parameter makes of a tensor subclass: isinstance(fake, nn.Parameter)
        memo[id(parameter)] = fake


def _fake_scripted(real: nn.Module, copied: nn.Module, memo: dict[int, Any]) -> None:
    """Put fake tensors in the place of the real ones ``deepcopy`` gave a TorchScript module's copy.

    TorchScript deep-copies its module in C++, tensors included, past the fake copy mode; each parameter and buffer
    is copied again here under it (into ``memo``: a tensor shared with a Python module stays one fake tensor) and
    set on the copy, which runs on them like any module.
    """
    places = scripted_tensors(copied)
    for (_owner, leaf, tensor), (owner, _leaf, _copied) in zip(scripted_tensors(real), places, strict=True):
        setattr(owner, leaf, copy.deepcopy(tensor, memo))


def move_module(module: nn.Module, device: torch.device) -> None:
    """Move the (fake) module's parameters and buffers to ``device`` in place (``.data``, keeping each object).

    Setting ``.data`` gives a fake tensor the moved tensor's dispatch keys but not its device, which a fake tensor
    keeps apart (``fake_device``): that is set too, or the parameter would still say it is on the CPU.
    """
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device != device:
            moved = tensor.data.to(device)
            tensor.data = moved
            if isinstance(tensor, FakeTensor) and isinstance(moved, FakeTensor):
                tensor.fake_device = moved.fake_device


def module_device(module: nn.Module) -> torch.device:
    """Where the module's first parameter (or buffer) is; the CPU for a module without tensors."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def fake_batch(
    batch: Any, mode: FakeTensorMode, substitutes: Substitutes
) -> tuple[Any, list[Tensor], list[tuple[Tensor, Tensor]]]:
    """A deep copy of ``batch`` with fake tensors, its tensors, and each fake tensor with the real one it copies.

    Any structure is copied: plain objects and dataclasses too. The objects in ``substitutes`` are not copied: the
    copy holds their substitutes.
    """
    memo: dict[int, Any] = dict(substitutes)
    with FakeCopyMode(mode), without_user_hooks():
        copied = copy.deepcopy(batch, memo)
    originals = memo.get(id(memo), [])  # deepcopy keeps every copied original alive in the memo, under its own id
    pairs = [(memo[id(real)], real) for real in originals if isinstance(real, Tensor) and id(real) in memo]
    return copied, [item for item in memo.values() if isinstance(item, Tensor)], pairs


def make_twin(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer] | None,
    batch: Any,
    mode: FakeTensorMode,
    prepare_module: Callable[[nn.Module], None] = lambda _module: None,
    substitutes: Substitutes | None = None,
    device_type: str | None = None,
) -> Twin:
    """The fake copy of ``module``, its gradients, ``optimizers`` and ``batch``.

    ``prepare_module`` changes the fake module before gradients and optimizers are attached (a replay's variant:
    a cast, inplace flags, checkpointed units). ``optimizers=None`` builds them with the copy's own
    ``configure_optimizers``, on its fake parameters. ``substitutes``: objects the copies hold instead of copying
    them (the arrays of :func:`shared_arrays`, themselves; the user's caches, fresh ones). ``device_type``: the
    device the real run trains on, where it is not the replay's (the optimizers take its path: foreach on CUDA).
    """
    substitutes = substitutes or {}
    copied, memo = fake_module(module, mode, substitutes)
    with mode:
        prepare_module(copied)
        parameters: dict[int, Tensor] = {}
        real_types: dict[int, type] = {}
        for real in module.parameters():
            fake = memo.get(id(real))
            if fake is None and id(real) in memo and is_flat_parameter(real):
                continue  # FSDP1's flat parameter: the copy holds the unit's original parameters, whole, instead
            if not isinstance(fake, Tensor):
                raise RuntimeError("a parameter of the module was not copied (a parameter held outside the module?)")
            parameters[id(real)] = fake
            real_types[id(fake)] = type(real)
            grad_kept = real.grad is not None and real.grad.shape == fake.shape  # not FSDP1's shard of a whole one
            if grad_kept and not (DTENSOR is not None and isinstance(real.grad, DTENSOR)):
                grad = mode.from_tensor(cast(Tensor, real.grad), static_shapes=True)
                same = (grad.dtype, grad.device) == (fake.dtype, fake.device)
                fake.grad = grad if same else grad.to(fake.device, fake.dtype)
        configured = configured_optimizers(copied) if optimizers is None else None
    if configured is None:
        configured = [rebuild_optimizer(optimizer, parameters, mode) for optimizer in optimizers or ()]
    for optimizer in configured:
        follow_real_path(optimizer, real_types, device_type)
    batch_copy, batch_tensors, batch_values = fake_batch(batch, mode, substitutes)
    return Twin(copied, configured, batch_copy, batch_tensors, batch_values)


def state_tensors(twin: Twin) -> list[Tensor]:
    """The twin's tensors alive when a step starts: parameters, buffers, gradients, optimizer state."""
    tensors = [*twin.module.parameters(), *twin.module.buffers()]
    tensors += [parameter.grad for parameter in twin.module.parameters() if parameter.grad is not None]
    for optimizer in twin.optimizers:
        tensors += iter_tensors(list(optimizer.state.values()))
    return tensors


def gradient_blocks(twin: Twin) -> list[int | None]:
    """Per parameter of the twin, its gradient's storage (the allocation listener's block id), or None: no gradient."""
    parameters = twin.module.parameters()
    return [None if each.grad is None else storage_key(local_tensor(each.grad)) for each in parameters]


def optimizer_state_blocks(twin: Twin) -> list[int]:
    """The storages of the twin's optimizer state (the allocation listener's block ids), in the state's order.

    Each once; not a parameter's storage (an optimizer that holds the parameter itself in its state).
    """
    parameters = {storage_key(local_tensor(parameter)) for parameter in twin.module.parameters()}
    tensors = [tensor for optimizer in twin.optimizers for tensor in iter_tensors(list(optimizer.state.values()))]
    blocks = dict.fromkeys(storage_key(local_tensor(tensor)) for tensor in tensors)
    return [block for block in blocks if block not in parameters]
