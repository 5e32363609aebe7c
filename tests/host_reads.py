"""Reads of real tensors' values inside a monitor's step hooks, on the CPU: a proxy for CUDA synchronisation.

On a GPU, a step hook that reads a device tensor's value (``.item()``, ``bool()``, ``.tolist()``, ``torch.equal``,
``nonzero``) or copies one to the host (``.cpu()``, ``.to("cpu")``), or makes a device tensor from host values
(``torch.tensor(..., device=...)``, a blocking copy), waits for the device: ``torch.cuda.set_sync_debug_mode`` calls
each of these a synchronisation. On the CPU nothing waits, but the same calls can be seen. :class:`HostReads` patches
them on ``torch.Tensor`` and in ``torch`` (Python-level patches: the monitor's replay turns the user's dispatch and
function modes off, a patch it cannot), and records each one made on a real tensor (not a fake one, not on ``meta``)
while one of the monitor's four step hooks runs, with the stack of the monitor's frames that made it. In a CPU run
every real tensor is a CPU tensor, so a read of the monitor's own host tensors is recorded too: each read says whether
the tensor shares a storage with the user's (parameters, buffers, gradients, optimizer state, the batch).

Not seen: reads made inside torch's C++ without a Python call (an op's kernel that calls ``item``), and a device
tensor the monitor makes and then reads (on the CPU it is a host tensor); ``scripts/sync_sites.py`` on a GPU sees all.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")
"""The hooks the GPU test runs under ``set_sync_debug_mode("error")``."""
TENSOR_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "equal", "nonzero")
"""``torch.Tensor`` methods that read a value or copy it to the host, whatever their arguments."""
FUNCTION_READS = ("equal", "nonzero", "masked_select", "unique")
"""``torch`` functions that read their first argument's values (or make an output shaped by them)."""
PACKAGE = str(Path(__file__).resolve().parents[1] / "lightning_vram")


@dataclass(frozen=True)
class HostRead:
    """One call that would synchronise a CUDA device, made inside a step hook.

    Attributes:
        call: what was called (``Tensor.item``, ``Tensor.to(cpu)``, ``torch.tensor(device=)``...).
        hook: the step hook it ran in.
        users: whether the tensor shares a storage with the user's parameters, buffers, gradients, optimizer state or
            batch.
        stack: the monitor's own frames that led to it, outermost first (``path:line in function``).
    """

    call: str
    hook: str
    users: bool
    stack: tuple[str, ...]

    def describe(self) -> str:
        """Two or more lines: the call, the hook, whose tensor, then the monitor's frames."""
        whose = "the user's tensor" if self.users else "another real tensor"
        return "\n".join([f"{self.call} in {self.hook} ({whose})", *(f"    {frame}" for frame in self.stack)])


class HostReads:
    """Records the host reads of real tensors made while ``monitor``'s step hooks run (see the module's docstring).

    Use as a context manager around ``trainer.fit``; :attr:`reads` holds what was seen, in order.
    """

    def __init__(self, monitor: pl.Callback) -> None:
        self.monitor = monitor
        self.reads: list[HostRead] = []
        self._hook: str | None = None
        self._users: set[int] = set()  # the data pointers of the user's storages, gathered as each hook starts
        self._undo: list[Callable[[], None]] = []

    def sites(self, users_only: bool = False) -> dict[tuple[str, tuple[str, ...]], list[HostRead]]:
        """The reads grouped by call and stack (one site each), in the order first seen."""
        grouped: dict[tuple[str, tuple[str, ...]], list[HostRead]] = {}
        for read in self.reads:
            if read.users or not users_only:
                grouped.setdefault((read.call, read.stack), []).append(read)
        return grouped

    def __enter__(self) -> HostReads:
        for name in STEP_HOOKS:
            self._wrap_hook(name)
        for name in TENSOR_READS:
            self._patch(Tensor, name, lambda tensor, *_, call=f"Tensor.{name}", **__: (call, tensor))
        self._patch(Tensor, "to", self._to_host)
        self._patch(Tensor, "copy_", self._copy)
        self._patch(Tensor, "__array__", lambda tensor, *_, **__: ("Tensor.__array__", tensor))
        for name in FUNCTION_READS:
            self._patch(torch, name, lambda tensor, *_, call=f"torch.{name}", **__: (call, tensor))
        self._patch(torch, "tensor", self._from_host)
        self._patch(torch, "as_tensor", self._from_host)
        self._patch(torch.cuda, "synchronize", lambda *_, **__: ("torch.cuda.synchronize", None))
        return self

    def __exit__(self, *_: object) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap_hook(self, name: str) -> None:
        original = getattr(self.monitor, name)

        @functools.wraps(original)
        def hook(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> Any:
            self._users = _user_storages(trainer, pl_module, (args, kwargs))
            self._hook = name
            try:
                return original(trainer, pl_module, *args, **kwargs)
            finally:
                self._hook = None

        setattr(self.monitor, name, hook)
        self._undo.append(lambda: delattr(self.monitor, name))

    def _patch(self, owner: Any, name: str, classify: Callable[..., tuple[str, Any] | None]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def patched(*args: Any, **kwargs: Any) -> Any:
            if self._hook is not None:
                seen = classify(*args, **kwargs)
                if seen is not None:
                    self._note(*seen)
            return original(*args, **kwargs)

        own = name in vars(owner)  # a method torch.Tensor inherits from its C base is taken off again, not set
        setattr(owner, name, patched)
        self._undo.append(lambda: setattr(owner, name, original) if own else delattr(owner, name))

    @staticmethod
    def _to_host(tensor: Any, *args: Any, **kwargs: Any) -> tuple[str, Any] | None:
        """``Tensor.to`` that names the CPU as its device and blocks (a copy to the host that waits, on a GPU)."""
        targets = [*args, kwargs.get("device")]
        to_cpu = any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)
        return ("Tensor.to(cpu)", tensor) if to_cpu and not kwargs.get("non_blocking", False) else None

    @staticmethod
    def _copy(target: Any, source: Any, non_blocking: bool = False) -> tuple[str, Any] | None:
        """A blocking ``copy_`` between real tensors (between the host and a device on a GPU, it waits)."""
        real = all(isinstance(t, Tensor) and not isinstance(t, FakeTensor) for t in (target, source))
        return ("Tensor.copy_", source) if real and not non_blocking else None

    @staticmethod
    def _from_host(data: Any, *args: Any, **kwargs: Any) -> tuple[str, Any] | None:
        """``torch.tensor``/``as_tensor`` onto a named non-CPU device from host values, or from a real tensor."""
        device = kwargs.get("device")
        if device is not None and torch.device(device).type not in ("cpu", "meta"):
            return "torch.tensor(device=)", None
        if isinstance(data, Tensor):
            return "torch.tensor(tensor)", data
        return None

    def _note(self, call: str, tensor: Any) -> None:
        if isinstance(tensor, Tensor) and (isinstance(tensor, FakeTensor) or tensor.device.type == "meta"):
            return
        users = isinstance(tensor, Tensor) and _storage_pointer(tensor) in self._users
        stack = tuple(
            f"{Path(frame.filename).relative_to(Path(PACKAGE).parent)}:{frame.lineno} in {frame.name}"
            for frame in traceback.extract_stack()
            if frame.filename.startswith(PACKAGE)
        )
        assert self._hook is not None
        self.reads.append(HostRead(call, self._hook, users, stack))


def _storage_pointer(tensor: Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass's wrapper)
        return None


def _user_storages(trainer: pl.Trainer, pl_module: pl.LightningModule, hook_arguments: Any) -> set[int]:
    """The data pointers of the tensors a GPU run keeps on the device: the parameters, buffers, gradients, optimizer
    state (Adam's ``step`` stays on the host unless ``capturable`` or ``fused``) and the hook's tensors (the batch)."""
    tensors: list[Tensor] = [*pl_module.parameters(), *pl_module.buffers()]
    tensors += [parameter.grad for parameter in pl_module.parameters() if parameter.grad is not None]
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            on_device = group.get("capturable") or group.get("fused")  # else torch keeps ``step`` on the host
            for parameter in group["params"]:
                state = optimizer.state.get(parameter, {})
                tensors += [v for k, v in state.items() if isinstance(v, Tensor) and (k != "step" or on_device)]
    tensors += [leaf for leaf in _leaves(hook_arguments) if isinstance(leaf, Tensor)]
    return {pointer for tensor in tensors if (pointer := _storage_pointer(tensor))}


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


@contextmanager
def host_reads(monitor: pl.Callback) -> Iterator[HostReads]:
    """:class:`HostReads` around a ``with`` block."""
    with HostReads(monitor) as reads:
        yield reads
