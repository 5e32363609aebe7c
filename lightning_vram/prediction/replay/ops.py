"""What the replay's dispatch modes read of every op, made cheap: it is read once per op and mode.

A replay's step runs each op through four modes of the project's (live count, workspace probe, known values,
deadline) and the fake mode below them. Most of the ops a fake step dispatches are no ops at all: C++ asks a fake
tensor for its device (``prim.device``: 3,644 of a GPT-2-class replay's 6,692 dispatches), each time through every
mode. :func:`device_query` answers it where it is first seen, as the fake mode would, so that the modes below are
not entered for it. The rest is read per op: its tensors (:func:`~lightning_vram.measure.tensors.op_tensors`), its
name and which of its arguments it writes, the last two worked out once per op.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vram.prediction.replay._fake import FakeTensor

_DEVICE = torch.ops.prim.device.default


def device_query(func: Any, args: Any) -> torch.device | None:
    """The fake device a ``prim.device`` query on one fake tensor returns; ``None`` for any other op.

    What the fake mode answers (``fake_tensor._device_handler``): the tensor's ``fake_device``. The query allocates
    nothing and computes nothing: no mode counts, times or values it.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     fake = torch.empty(2)
    >>> device_query(torch.ops.prim.device.default, (fake,)), device_query(torch.ops.aten.add.Tensor, (fake, fake))
    (device(type='cpu'), None)
    """
    if func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
        device: torch.device = args[0].fake_device
        return device
    return None


_NAMES: dict[Any, str] = {}
_WRITES: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}
_NO_WRITES: tuple[tuple[int, ...], tuple[str, ...]] = ((), ())


def op_name(func: Any) -> str:
    """An op's name without namespace or overload: ``aten._log_softmax.default`` -> ``_log_softmax``.

    >>> op_name(torch.ops.aten._log_softmax.default)
    '_log_softmax'
    """
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(getattr(func, "__name__", func)).split(".")[0]
    return name


def written_arguments(func: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The arguments ``func`` writes into: their positions, and their names as keywords (none without a schema).

    >>> written_arguments(torch.ops.aten.add_.Tensor), written_arguments(torch.ops.aten.add.Tensor)
    (((0,), ('self',)), ((), ()))
    """
    written = _WRITES.get(func)
    if written is None:
        schema = getattr(func, "_schema", None)
        written = _NO_WRITES
        if schema is not None and schema.is_mutable:
            writes = [
                (position, argument.name)
                for position, argument in enumerate(schema.arguments)
                if argument.alias_info is not None and argument.alias_info.is_write
            ]
            written = (tuple(position for position, _ in writes), tuple(name for _, name in writes))
        _WRITES[func] = written
    return written
