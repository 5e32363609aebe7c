"""Checkpointing whose recomputation starts from the buffers as forward found them and leaves them as it left them.

Backward re-runs a checkpointed unit's forward. A train-mode BatchNorm in it would update its running statistics
(and ``num_batches_tracked``) a second time each step (pytorch/pytorch#96136); a unit whose forward updates buffers
and then computes with them (spectral normalisation's power iteration, a running-statistics normaliser) would
recompute from the updated values, another output than forward's, and get other gradients. The forward pass keeps a
copy of the units' buffers as it finds them; the recomputation runs on a copy of those, and the buffers as forward
left them are put back after it: the recomputed outputs are forward's (the same kernels on the same values) and the
buffers change once a step, as without checkpointing. The kept copy is held from the unit's forward to its
recomputation. This is what the advice prints (``checkpoint_keeping_buffers`` in
:mod:`lightning_vram.advice.checkpoint_code`); the replay runs it so that its figures are those of the printed code,
the copies included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
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


Kept = dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor]]
"""Buffers by ``(id(module), name)``: the module, the buffer's name and a tensor."""


def _buffers_of(modules: Iterable[nn.Module]) -> Kept:
    """Every buffer of ``modules`` and their submodules (a parametrization's included)."""
    found: Kept = {}
    for owner in modules:
        for module in owner.modules():
            for name, buffer in module.named_buffers(recurse=False):
                found[id(module), name] = (module, name, buffer)
    return found


@contextmanager
def buffers_kept(modules: Iterable[nn.Module], kept: Kept) -> Iterator[None]:
    """Keep in ``kept`` a copy of every buffer of ``modules`` as the body (a unit's forward) finds them."""
    kept.update({key: (module, name, buffer.clone()) for key, (module, name, buffer) in _buffers_of(modules).items()})
    yield


@contextmanager
def buffers_as_kept(kept: Kept) -> Iterator[None]:
    """Run the body (the recomputation) on copies of the ``kept`` buffers; put back the buffers as they are now."""
    current = {key: (module, name, getattr(module, name)) for key, (module, name, _) in kept.items()}
    for module, name, buffer in kept.values():
        setattr(module, name, buffer.clone())
    try:
        yield
    finally:
        for module, name, buffer in current.values():
            setattr(module, name, buffer)


def checkpoint_keeping_buffers(
    modules: Iterable[nn.Module], function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``checkpoint(function, *args, use_reentrant=False, **kwargs)``, recomputed on copies of ``modules``' buffers.

    The copies are of the buffers as the forward pass found them (kept from then to the recomputation).
    """
    owners = list(modules)

    def contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        kept: Kept = {}
        return buffers_kept(owners, kept), buffers_as_kept(kept)

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


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
        kept: Kept = {}
        return _both(forward, buffers_kept(owners, kept)), _both(recompute, buffers_as_kept(kept))

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)
