"""Backward on fake CUDA tensors without a CUDA device: the autograd graph walked in Python, node by node.

A CUDA build of torch fakes CUDA tensors on a machine without a GPU (the fake mode swaps CUDA's device guard for a
no-op one), and forward runs; but autograd's engine stops before the first node: ``GraphTask::stash_current_streams``
counts one device through that no-op guard, then asks the CUDA hooks whether device 0 has a primary context, and
they check the real device count (zero): ``hasPrimaryContext expects a valid device index, but got
device_index=0`` (torch 2.14). :func:`graph_backward` does the engine's work for a replay instead: each node runs
once its every consumer has run, the most recently created first (the engine's order on one device), with the
engine's own treatment of what a node returns (summed to the input's shape, cast to its dtype), sums of gradients
out of place, and a leaf's gradient taken over (or added in place) as ``AccumulateGrad`` does. The loss lets go of
its graph first, so that each node, and what it saved, is freed once it has run, as the engine's
``release_variables`` frees it.

A leaf's hooks run (``Tensor.register_hook`` and ``register_post_accumulate_grad_hook`` on a parameter). Not run:
hooks on autograd nodes and on tensors that are not leaves (``Node.register_hook``, module backward hooks,
``retain_grad``), whose registries torch keeps in C++; ``create_graph``; ``torch.autograd.grad``.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch
from torch import Tensor

_ACCUMULATE_GRAD = "AccumulateGrad"


def _graph_dependencies(root: Any) -> dict[Any, int]:
    """How many edges lead to each node reachable from ``root``."""
    dependencies: dict[Any, int] = {}
    seen = {root}
    pending = [root]
    while pending:
        node = pending.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            dependencies[child] = dependencies.get(child, 0) + 1
            if child not in seen:
                seen.add(child)
                pending.append(child)
    return dependencies


def _accumulate(node: Any, gradient: Tensor) -> None:
    """``AccumulateGrad``: the leaf takes the gradient over (laid out as the leaf), or adds it in place.

    The leaf's own hooks run first (``Tensor.register_hook``), its post-accumulate hooks after
    (``Tensor.register_post_accumulate_grad_hook``: the replay's counter hears of each gradient through one).
    """
    variable: Tensor = node.variable
    for hook in tuple((getattr(variable, "_backward_hooks", None) or {}).values()):
        replaced = hook(gradient)
        if replaced is not None:
            gradient = replaced
    if variable.grad is None:
        if gradient.stride() != variable.stride() and variable.is_contiguous():
            gradient = gradient.contiguous()  # the engine's clone_obey_contract
        variable.grad = gradient.detach()
    else:
        variable.grad += gradient
    for hook in tuple((getattr(variable, "_post_accumulate_grad_hooks", None) or {}).values()):
        hook(variable)


def _as_input(node: Any, index: int, gradient: Tensor) -> Tensor:
    """A node's output gradient as its consumer's input ``index`` expects it (the engine's ``validate_outputs``)."""
    metadata = node._input_metadata[index]
    if tuple(gradient.shape) != tuple(metadata.shape):
        gradient = gradient.sum_to_size(metadata.shape)
    if gradient.dtype != metadata.dtype:
        gradient = gradient.to(metadata.dtype)
    return gradient


def _run(node: Any, inputs: list[Tensor | None]) -> Any:
    """Run one node: torch's own (a C++ node, callable) or an ``autograd.Function``'s (its ``apply``).

    A Python node gets zeros for the gradients that did not arrive, unless its ``ctx`` said
    ``set_materialize_grads(False)``, as the engine gives it.
    """
    if callable(node):
        return node(*inputs)
    if getattr(node, "materialize_grads", True):
        inputs = [
            torch.zeros(metadata.shape, dtype=metadata.dtype, device=metadata.device) if gradient is None else gradient
            for gradient, metadata in zip(inputs, node._input_metadata, strict=True)
        ]
    return node.apply(*inputs)


def graph_backward(loss: Tensor) -> None:
    """``loss.backward()`` for a scalar ``loss``, without autograd's engine; the loss is detached afterwards."""
    root = loss.grad_fn
    if root is None:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    seed = torch.ones_like(loss)  # held to the end, as torch.autograd.backward holds its grad_tensors
    dependencies = _graph_dependencies(root)
    buffers: dict[Any, list[Tensor | None]] = {root: [seed]}
    loss.detach_()  # the loss lets go of the graph: each node (and what it saved) is freed once it has run
    order = itertools.count()
    ready: list[tuple[int, int, Any]] = [(-root._sequence_nr(), next(order), root)]
    del root
    with torch.no_grad():
        while ready:
            node = heapq.heappop(ready)[2]
            inputs = buffers.pop(node)
            if type(node).__name__ == _ACCUMULATE_GRAD:
                gradient = inputs[0]
                del inputs
                if gradient is not None:
                    _accumulate(node, gradient)
                del gradient, node
                continue
            outputs = _run(node, inputs)
            del inputs
            if not isinstance(outputs, tuple):
                outputs = (outputs,)
            for (child, index), gradient in zip(node.next_functions, outputs, strict=False):
                if child is None:
                    continue
                slot = buffers.setdefault(child, [None] * len(child._input_metadata))
                if gradient is not None:
                    gradient = _as_input(child, index, gradient)
                    held = slot[index]
                    slot[index] = gradient if held is None else held + gradient
                    del held
                del gradient
                dependencies[child] -= 1
                if dependencies[child] == 0:
                    del dependencies[child]
                    heapq.heappush(ready, (-child._sequence_nr(), next(order), child))
            del outputs, node
    del seed


def engine_can_run(device: torch.device) -> bool:
    """Whether autograd's engine can run a backward on ``device``'s (fake) tensors in this process.

    Fake CUDA without a CUDA device is the one case it cannot (see the module's docstring).
    """
    return device.type != "cuda" or torch.cuda.is_available()
