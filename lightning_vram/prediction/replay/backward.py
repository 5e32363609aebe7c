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

Non-reentrant checkpointing works as under the engine: the walk is one ``GraphExecGroup`` (one recomputation per
unit), tells the monitor's counting which node runs (:func:`~lightning_vram.measure._recompute.walking_node`), and
empties each checkpoint frame once spent. A leaf's hooks run (``Tensor.register_hook`` and
``register_post_accumulate_grad_hook`` on a parameter). Not run: hooks on autograd nodes and on tensors that are not
leaves (``Node.register_hook``, module backward hooks, ``retain_grad``), whose registries torch keeps in C++;
``create_graph``; anything that calls the engine itself (``torch.autograd.grad``, reentrant checkpointing): that
raises torch's error, and the replay is skipped with it.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from lightning_vram.measure._recompute import walking_node

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


def _one_graph_task() -> contextlib.AbstractContextManager[Any]:
    """One id for the whole walk where non-reentrant checkpointing asks for the engine's graph task.

    Outside the engine it makes a new id at every unpack, and so recomputes its unit for every tensor it saved
    (GPT-2's two blocks: 248 matrix products where 16 run); ``GraphExecGroup`` (in torch 2.13 and 2.14) gives it one.
    """
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    return contextlib.nullcontext() if group is None else group()


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


def _spent(frame: Any) -> bool:
    """Whether a non-reentrant checkpoint frame has recomputed and every tensor it saved has been unpacked."""
    if not any(getattr(frame, "is_recomputed", {}).values()):
        return False
    holders = [reference() for reference in getattr(frame, "weak_holders", ())]
    return all(holder is None or all(handle is None for handle in holder.handles.values()) for holder in holders)


def _release_spent(frames: list[Any]) -> list[Any]:
    """Empty the spent frames (:func:`_spent`); the others, still to be spent."""
    pending = []
    for frame in frames:
        if _spent(frame):
            vars(frame).clear()
        else:
            pending.append(frame)
    return pending


def graph_backward(loss: Tensor, checkpoint_frames: Iterable[Any] = ()) -> None:
    """``loss.backward()`` for a scalar ``loss``, without autograd's engine; the loss is detached afterwards.

    ``checkpoint_frames``: the non-reentrant checkpoint frames the step made. Each is emptied once its unit has been
    recomputed and all it saved unpacked, when the engine would have freed it: what a frame holds (its unit's inputs,
    a transformers cache of every layer's keys and values) can reach the nodes that hold the frame, a cycle through
    autograd's C++ that the engine breaks by releasing each node's saved tensors, and the garbage collector cannot see.
    """
    root = loss.grad_fn
    if root is None:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    seed = torch.ones_like(loss)  # held to the end, as torch.autograd.backward holds its grad_tensors
    dependencies = _graph_dependencies(root)
    buffers: dict[Any, list[Tensor | None]] = {root: [seed]}
    loss.detach_()  # the loss lets go of the graph: each node (and what it saved) is freed once it has run
    frames = list(checkpoint_frames)
    order = itertools.count()
    ready: list[tuple[int, int, Any]] = [(-root._sequence_nr(), next(order), root)]
    del root
    with torch.no_grad(), _one_graph_task():
        while ready:
            node = heapq.heappop(ready)[2]
            inputs = buffers.pop(node)
            if type(node).__name__ == _ACCUMULATE_GRAD:
                gradient = inputs[0]
                del inputs
                if gradient is not None:
                    with walking_node(node._sequence_nr()):
                        _accumulate(node, gradient)
                del gradient, node
                continue
            with walking_node(node._sequence_nr()):
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
            if frames:
                frames = _release_spent(frames)
    del seed


def engine_can_run(device: torch.device) -> bool:
    """Whether autograd's engine can run a backward on ``device``'s (fake) tensors in this process.

    Fake CUDA without a CUDA device is the one case it cannot (see the module's docstring).
    """
    return device.type != "cuda" or torch.cuda.is_available()
