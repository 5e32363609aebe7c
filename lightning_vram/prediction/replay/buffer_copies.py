"""Checkpointing whose recomputation leaves the modules' buffers as the forward pass left them.

Backward re-runs a checkpointed unit's forward; a train-mode BatchNorm in it would update its running statistics
(and ``num_batches_tracked``) a second time each step (pytorch/pytorch#96136), and the checkpointed model would
learn different statistics than the plain one. The recomputation runs on copies of the buffers instead, and the
originals are put back after it: the recomputed outputs are the same (the same kernels on the same values) and the
buffers change once a step, as without checkpointing. This is what the advice prints (``checkpoint_keeping_buffers``
in :mod:`lightning_vram.advice.checkpoint_code`); the replay runs it so that its figures are those of the printed
code, the copies included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

SAVED_OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
)
"""The ops whose outputs selective checkpointing keeps (matrix products, convolutions, attention: the FLOPs of a
unit); every other op of the unit (norms, activations, dropout, additions) is recomputed in backward."""


@contextmanager
def buffers_copied(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run the body with every buffer of ``modules`` (and their submodules) replaced by a copy; put them back."""
    originals: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor]] = {}
    for owner in modules:
        for module in owner.modules():
            for name, buffer in module.named_buffers(recurse=False):
                originals[id(module), name] = (module, name, buffer)
    for module, name, buffer in originals.values():
        setattr(module, name, buffer.clone())
    try:
        yield
    finally:
        for module, name, buffer in originals.values():
            setattr(module, name, buffer)


def checkpoint_keeping_buffers(
    modules: Iterable[nn.Module], function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``checkpoint(function, *args, use_reentrant=False, **kwargs)``, recomputed on copies of ``modules``' buffers."""
    owners = list(modules)
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (nullcontext(), buffers_copied(owners)),
        **kwargs,
    )


def _keep_matmuls(_context: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep the outputs of :data:`SAVED_OPS`, recompute every other op."""
    name = str(getattr(op, "overloadpacket", op))
    return CheckpointPolicy.MUST_SAVE if name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _both(first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> Iterator[None]:
    """Both contexts, ``first`` entered first."""
    with ExitStack() as stack:
        stack.enter_context(first)
        stack.enter_context(second)
        yield


def checkpoint_saving_matmuls(
    modules: Iterable[nn.Module], function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """:func:`checkpoint_keeping_buffers` made selective: the outputs of :data:`SAVED_OPS` are kept from forward.

    Only the other ops are recomputed (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
    """
    owners = list(modules)

    def contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward, recompute = create_selective_checkpoint_contexts(_keep_matmuls)  # type: ignore[no-untyped-call]
        return forward, _both(recompute, buffers_copied(owners))

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)
