"""DDP's gradient buckets: what torch's ``DistributedDataParallel`` holds on each rank beyond the module's tensors.

DDP's Reducer reduces gradients in buckets, flat tensors allocated when DDP is built (torch 2.13,
``torch/nn/parallel/distributed.py`` and its C++ Reducer):

- Every parameter that requires a gradient, is not in ``parameters_to_ignore`` and does not expect a sparse
  gradient (an ``nn.Embedding(sparse=True)``'s) has its slot in a bucket of its dtype and device, packed without
  padding: the buckets together are one gradient's bytes of every such parameter.
- With ``gradient_as_bucket_view=False`` (the default) the buckets are a second copy of every gradient, held for the
  whole run: backward copies each gradient into its slot (divided by the world size), the bucket is all-reduced in
  place, and the result is copied back into ``param.grad``. With ``gradient_as_bucket_view=True`` the gradients
  are views of the buckets: nothing beyond them, but the buckets stay alive where the gradients are set to ``None``.
- Buckets are sized by ``bucket_cap_mb`` (25 MiB by default) with a smaller first bucket (1 MiB,
  ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, where ``bucket_cap_mb`` is left to its default); a bucket
  closes once it reaches its cap, so one can exceed it by its last parameter. Without ``find_unused_parameters``
  (or with ``static_graph``) DDP first keeps one bucket for everything, then rebuilds them at its second forward
  pass in the order the first backward made the gradients ready; the total is the same.

DDP's other state (its parameters and buffers broadcast at construction, the buffers it broadcasts at each forward
with ``broadcast_buffers=True``, gloo's and NCCL's own buffers outside torch's allocator) is not counted here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_vram.records import StrategyBuffers

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's bucket cap where ``bucket_cap_mb`` is left to its default (``_DEFAULT_BUCKET_CAP_MB``)."""
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""DDP's first bucket's cap where ``bucket_cap_mb`` is left to its default (``_DEFAULT_FIRST_BUCKET_BYTES``)."""
LABEL = "DDP gradient buckets"
"""How the report names the buckets' line."""


def find_ddp(wrapper: nn.Module | None) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` training runs the model through, or ``None`` where there is none.

    That is ``wrapper`` itself (a Lightning strategy's ``model``), or the module a Fabric wrapper forwards to.
    """
    for candidate in (wrapper, getattr(wrapper, "_forward_module", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def replay_refusal(ddp: DistributedDataParallel) -> str | None:
    """Why a replay plus the buckets' arithmetic would not be this rank's step under ``ddp``; ``None`` when it is."""
    if ddp.gradient_as_bucket_view:
        return (
            "DDP with gradient_as_bucket_view=True: the gradients are views of DDP's buckets, which the replay does not"
            " reproduce yet"
        )
    if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_use_python_reducer", False):
        return "DDP with a communication hook or the Python reducer: their buffers are not modelled"
    if getattr(ddp, "mixed_precision", None) is not None or getattr(ddp, "_delay_all_reduce_params", None):
        return "DDP's mixed_precision or delayed all-reduce: their buffers are not modelled"
    return None


def reduced_parameters(module: nn.Module, ignored: Collection[str] = ()) -> list[nn.Parameter]:
    """The parameters whose gradients DDP's buckets hold, in registration order (as DDP lists them).

    Every parameter of ``module`` that requires a gradient, is not named in ``ignored`` (DDP's
    ``parameters_to_ignore``) and is not an ``nn.Embedding(sparse=True)``'s; shared ones once.
    """
    seen: set[int] = set()
    reduced = []
    for module_name, child in module.named_modules():
        sparse = isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
        for name, parameter in child.named_parameters(recurse=False):
            if not parameter.requires_grad or f"{module_name}.{name}" in ignored or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            if not sparse:
                reduced.append(parameter)
    return reduced


def bucket_sizes(
    parameters: Sequence[nn.Parameter], cap_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None
) -> StrategyBuffers:
    """DDP's buckets for ``parameters`` (as :func:`reduced_parameters` lists them), by its arithmetic.

    Each bucket's bytes, filled in reverse registration order (the order backward usually makes gradients ready,
    which DDP's rebuild follows) to the first bucket's cap, then to ``cap_bytes`` (``bucket_cap_mb``) each, one
    dtype and device per bucket (each with its own first bucket); their sum is exact, their split the usual one.
    ``dtype``: the parameters' dtype where the step casts them (a ``*-true`` precision); ``None``: their own.
    """
    first = DEFAULT_FIRST_BUCKET_BYTES if cap_bytes == DEFAULT_BUCKET_BYTES else cap_bytes
    buckets: list[int] = []
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: set[tuple[torch.dtype, torch.device]] = set()  # the dtypes and devices whose first bucket closed
    for parameter in reversed(parameters):
        cast = dtype if dtype is not None and parameter.is_floating_point() else parameter.dtype
        key = (cast, parameter.device)
        open_bytes[key] = open_bytes.get(key, 0) + parameter.numel() * cast.itemsize
        if open_bytes[key] >= (cap_bytes if key in closed else first):
            buckets.append(open_bytes.pop(key))
            closed.add(key)
    buckets += open_bytes.values()
    basis = (
        f"gradient_as_bucket_view=False: a second copy of every reduced gradient, held for the whole run; buckets"
        f" of {first} bytes first, then {cap_bytes} (bucket_cap_mb), in reverse parameter order (torch's Reducer)"
    )
    return StrategyBuffers(LABEL, tuple(buckets), basis)


def predicted_buckets(ddp: DistributedDataParallel) -> StrategyBuffers:
    """DDP's buckets as its arithmetic gives them, for a replay to hold (``gradient_as_bucket_view=False``).

    See :func:`bucket_sizes`; the parameters and the cap are ``ddp``'s own.
    """
    ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
    return bucket_sizes(reduced_parameters(ddp.module, ignored), int(ddp.bucket_bytes_cap))


def live_buckets(ddp: DistributedDataParallel) -> tuple[int, ...]:
    """The bytes of each bucket DDP holds now, for a sampled step's live count to hold from its start.

    Empty where they are counted otherwise: with ``gradient_as_bucket_view=True`` (the gradients are the buckets),
    and where DDP rebuilds its buckets at the coming forward pass (its second one), which the live count sees
    allocate them. Read from the Reducer, which copies its buckets' shapes into new zeroed tensors: this allocates
    and frees their bytes once (call only where no allocator's peak is read, the CPU).
    """
    if ddp.gradient_as_bucket_view:
        return ()
    rebuilds = ddp.static_graph or not ddp.find_unused_parameters
    ran, rebuilt = getattr(ddp, "_lazy_init_ran", True), getattr(ddp, "_has_rebuilt_buckets", True)
    if rebuilds and ran and not rebuilt:  # rebuilt at this forward
        return ()
    shaped_like = getattr(ddp.reducer, "_get_zeros_like_grad_buckets", None)
    if shaped_like is None:  # another torch: the buckets count from the first op that writes them, as before
        return ()
    return tuple(bucket.buffer().untyped_storage().nbytes() for bucket in shaped_like())
