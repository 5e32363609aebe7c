"""Ops whose fake kernel leaves out a workspace the real kernel keeps for backward, measured on the CPU instead.

oneDNN's recurrent layers (``aten.mkldnn_rnn_layer``: CPU LSTM and GRU) keep a workspace for backward whose size
oneDNN alone knows; their fake kernel returns an empty one. On the CPU the real kernel is run once per distinct
shape on uninitialised tensors of those shapes (host memory for one layer, freed at once) and the fake workspace
is given the size it reported. cuDNN's recurrent layers (``aten._cudnn_rnn``) have the same gap and no such
measurement: :attr:`WorkspaceProbe.unmeasured` names them, so a replay can say what it left out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_vram.prediction.replay._fake import (
    FakeTensor,
    TorchDispatchMode,
    tree_leaves,
    tree_map_only,
    unset_fake_temporarily,
)

MEASURED_ON_CPU = {torch.ops.aten.mkldnn_rnn_layer.default: 3}
"""Op -> the index of its workspace output, measured by running the real kernel on the CPU."""
PROBE_MAX_BYTES = 4 * 1024**2
"""Inputs and outputs (as the fake kernel sizes them) of one measuring run; its workspace is about 20 times its
output, so one run takes well under 100 MiB of host memory."""
UNMEASURED = frozenset({torch.ops.aten._cudnn_rnn.default})
"""Ops whose fake workspace is empty where the real one is not, with no way to measure it here."""


# torch ships TorchDispatchMode without annotations.
class WorkspaceProbe(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Gives the fake workspaces of :data:`MEASURED_ON_CPU` their real size; notes ops of :data:`UNMEASURED`.

    Enter it inside the fake mode and before (below) the mode that counts live tensors, so that the counting sees
    the corrected outputs.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._sizes: dict[tuple[Any, ...], int] = {}
        self.unmeasured: set[str] = set()
        """Names of the ops met whose workspace the replay could not size."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if func in UNMEASURED:
            self.unmeasured.add(str(func))
        index = MEASURED_ON_CPU.get(func)
        if index is None or not isinstance(output, tuple) or output[index].device.type != "cpu":
            return output
        size = self._real_size(func, args, kwargs, index, _nbytes((args, output)))
        if size == output[index].numel():
            return output
        corrected = list(output)
        corrected[index] = output[index].new_empty(size)
        return tuple(corrected)

    def _real_size(self, func: Any, args: Any, kwargs: Any, index: int, nbytes: int) -> int:
        key = (func, *_signature(args), *_signature(tuple(kwargs.items())))
        size = self._sizes.get(key)
        if size is None:
            batch, shrink = _rnn_batch(args), max(1, -(-nbytes // PROBE_MAX_BYTES))
            smaller = max(1, batch // shrink)
            shrunk = _rnn_with_batch(args, batch, smaller)
            with unset_fake_temporarily():
                real_args = tree_map_only(FakeTensor, _empty_like, shrunk)
                real_kwargs = tree_map_only(FakeTensor, _empty_like, kwargs)
                workspace = func(*real_args, **real_kwargs)[index]
            measured = workspace.numel() if isinstance(workspace, Tensor) else 0
            size = measured if smaller == batch else -(-measured * batch // smaller)
            self._sizes[key] = size
        return size


def _rnn_batch(args: Any) -> int:
    """The batch size of an ``mkldnn_rnn_layer`` call: the first dimension of ``hx`` (argument 5)."""
    hidden: Tensor = args[5]
    return int(hidden.shape[0])


def _rnn_with_batch(args: Any, batch: int, smaller: int) -> Any:
    """``mkldnn_rnn_layer``'s arguments with their batch dimension at ``smaller``, as fake tensors.

    The batch dimension is that of the input (``(time, batch, features)``, as torch passes it) and of ``hx``,
    ``cx`` (arguments 5 and 6). Call it under the fake mode.
    """
    if smaller == batch:
        return args
    resized = list(args)
    shape = list(args[0].shape)
    shape[1 if shape[1] == batch else 0] = smaller
    resized[0] = args[0].new_empty(shape)
    for position in (5, 6):
        state = args[position]
        if isinstance(state, Tensor) and state.dim() > 0 and state.shape[0] == batch:
            resized[position] = state.new_empty((smaller, *state.shape[1:]))
    return tuple(resized)


def _nbytes(value: Any) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(value) if isinstance(leaf, Tensor))


def _empty_like(tensor: Tensor) -> Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype)


def _signature(values: Any) -> list[Any]:
    """A hashable description of op arguments: shapes and dtypes of tensors, other values as they are."""
    described: list[Any] = []
    for value in values:
        if isinstance(value, Tensor):
            described.append((tuple(value.shape), value.dtype))
        elif isinstance(value, (list, tuple)):
            described.append(tuple(_signature(value)))
        else:
            described.append(value)
    return described
