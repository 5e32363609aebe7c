"""CUDA's dropout and attention kernels, in a replay for CUDA that runs where torch would pick other kernels.

A step predicted for a CUDA device is replayed on the CPU where torch is a CPU-only build (``predict()``,
``lightning-vram plan`` on a laptop), and on fake CUDA tensors where torch is a CUDA build without a device. Either
way two ops a transformer trains with save more for backward than on a GPU:

- **dropout**: in training, ``F.dropout`` on CUDA runs ``native_dropout``, which saves a ``bool`` mask (1 byte an
  element); on any other device it multiplies the input by a noise tensor of the input's dtype, which it saves
  (4 bytes an element in ``float32``) (``aten/src/ATen/native/Dropout.cpp``: ``dropout`` takes ``native_dropout``
  where ``is_fused_kernel_acceptable``: a CUDA input, ``0 < p < 1``, elements). In-place dropout, and ``p`` of 0
  or 1, take the noise path on CUDA too.
- **attention**: ``F.scaled_dot_product_attention`` asks the device which kernel to run
  (``aten/src/ATen/native/transformers/attention.cpp``: ``_fused_sdp_choice``). CUDA's choice without a device
  (``cuda/sdp_utils.cpp``: every fused kernel's ``check_*_hardware_support`` needs a device) is the math path, which
  saves the (batch, heads, queries, keys) attention weights, the weights after dropout and dropout's mask, per call;
  the CPU's is its own flash kernel where that takes the inputs (no dropout), else the math path. A GPU runs flash or
  memory-efficient attention, which save the output and one ``float32`` log-sum-exp per query row (by heads), the
  dropout drawn again in backward from a saved seed, and the math path where neither takes the inputs.

:class:`CudaKernels` sends these calls on fake tensors to the kernels CUDA runs: ``native_dropout``, and
``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention`` or
``_scaled_dot_product_attention_math`` as :func:`cuda_attention` chooses them (their fake kernels and backward
formulas exist in every build of torch). A replay for CUDA enters it
only where torch cannot choose CUDA's kernels itself (no CUDA device); a replay on a GPU, and one for the CPU, never.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable
from types import FunctionType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.torch_version import TorchVersion

from lightning_vram.prediction.replay._fake import FakeTensor

FLASH_DTYPES = frozenset({torch.float16, torch.bfloat16})
"""Flash attention's dtypes on compute capability 8.0 and later (``check_dtypes_low_precision``)."""
EFFICIENT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
"""Memory-efficient attention's dtypes on compute capability 8.0 and later (``can_use_mem_efficient_attention``)."""
EFFICIENT_GQA = TorchVersion(torch.__version__) >= "2.14"
"""Whether this torch's memory-efficient attention takes grouped-query inputs (``enable_gqa``, fewer key/value heads
than query heads). Before 2.14 ``can_use_mem_efficient_attention`` checks
``check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention=*/>`` and its backward's fake kernel
gives the key's and value's gradients the query's heads; pytorch/pytorch#191085 (torch 2.14) made it take them."""
FLASH_MAX_HEAD_DIM = 256
"""Flash attention's largest head dimension (``check_head_dim_size_flash``), elements."""
FLASH_HEAD_DIM_ALIGNMENT = 8
"""Flash attention's inputs are padded to a head dimension that is a multiple of this (``pad_last_dim<8>``)."""
AUTOCAST_DEVICES = ("cpu", "cuda")
"""The device types a replay runs autocast on (torch has none for the meta device)."""
MASK_ALIGNMENT = 8
"""Memory-efficient attention's mask is padded unless each stride but the last is a multiple of this
(``preprocess_mask``), elements."""


def _functional_dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> None:
    """``F.dropout``'s signature, to bind a call's arguments."""


def _torch_dropout(input: Tensor, p: float, train: bool) -> None:
    """``torch.dropout``'s signature, to bind a call's arguments."""


def _attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> None:
    """``F.scaled_dot_product_attention``'s signature, to bind a call's arguments."""


_FUNCTIONAL_DROPOUT = inspect.signature(_functional_dropout)
_TORCH_DROPOUT = inspect.signature(_torch_dropout)
_ATTENTION_SIGNATURE = inspect.signature(_attention)
_TENSOR_BACKWARD = inspect.signature(Tensor.backward)
_AUTOGRAD_BACKWARD = inspect.signature(torch.autograd.backward)


def cuda_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> SDPBackend:
    """The kernel ``F.scaled_dot_product_attention`` runs on a GPU of compute capability 8.0 or later (A100, H100).

    As ``select_sdp_backend`` (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) picks it for dense inputs,
    in its default order, with the kernels ``torch.backends.cuda`` (or ``torch.nn.attention.sdpa_kernel``) leaves
    enabled: flash attention for ``float16``/``bfloat16`` inputs without a mask (equal head dimensions up to 256;
    with ``is_causal``, as many queries as keys; grouped-query inputs too); else memory-efficient attention
    (``float32`` too, any mask; head dimensions a multiple of 4 in ``float32``, 8 otherwise, and storage offsets
    likewise; grouped-query inputs only from torch 2.14, :data:`EFFICIENT_GQA`); else the math path, which for
    grouped-query inputs repeats the key's and value's heads to the query's first.
    cuDNN attention, which torch prefers on compute capability 9.0 and 10.x with cuDNN above 9.15, is not chosen
    here: it saves what flash attention saves for inputs without a mask (the output and a log-sum-exp per query row).

    >>> q = torch.empty(2, 4, 16, 64)
    >>> cuda_attention(q, q, q, is_causal=True), cuda_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())
    (<SDPBackend.EFFICIENT_ATTENTION: 2>, <SDPBackend.FLASH_ATTENTION: 1>)
    >>> cuda_attention(q[..., :30], q[..., :30], q[..., :30])  # a head dimension of 30 in float32
    <SDPBackend.MATH: 0>
    >>> kv = torch.empty(2, 2, 16, 64)  # grouped-query attention: 4 query heads, 2 key/value heads
    >>> cuda_attention(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), enable_gqa=True)
    <SDPBackend.FLASH_ATTENTION: 1>
    >>> cuda_attention(q, kv, kv, enable_gqa=True) == (  # float32: no flash attention
    ...     SDPBackend.EFFICIENT_ATTENTION if EFFICIENT_GQA else SDPBackend.MATH
    ... )
    True
    """
    tensors = (query, key, value)
    if any(tensor.dim() != 4 or tensor.is_nested for tensor in tensors) or not _batch_and_heads(
        query, key, value, enable_gqa
    ):
        return SDPBackend.MATH
    if query.size(-2) == 0 or key.size(-2) == 0:
        return SDPBackend.MATH
    dtype = query.dtype
    if any(tensor.dtype != dtype for tensor in tensors):
        return SDPBackend.MATH
    head_dims = {tensor.size(-1) for tensor in tensors}
    flash = (
        torch.backends.cuda.flash_sdp_enabled()  # type: ignore[no-untyped-call]  # torch ships it unannotated
        and dtype in FLASH_DTYPES
        and attn_mask is None
        and len(head_dims) == 1
        and query.size(-1) <= FLASH_MAX_HEAD_DIM
        and not (is_causal and query.size(-2) != key.size(-2))
        and all(tensor.stride(-1) == 1 or tensor.size(-1) == 1 for tensor in tensors)
    )
    if flash:
        return SDPBackend.FLASH_ATTENTION
    alignment = 4 if dtype == torch.float32 else 8  # minimum_gemm_alignment: 128 bits on tensor cores
    efficient = (
        torch.backends.cuda.mem_efficient_sdp_enabled()  # type: ignore[no-untyped-call]
        and (EFFICIENT_GQA or query.size(1) == key.size(1))
        and dtype in EFFICIENT_DTYPES
        and query.size(-1) == key.size(-1)
        and all(tensor.size(-1) % alignment == 0 for tensor in (query, value))
        and all(tensor.storage_offset() % alignment == 0 and tensor.stride(-1) == 1 for tensor in tensors)
    )
    return SDPBackend.EFFICIENT_ATTENTION if efficient else SDPBackend.MATH


def _batch_and_heads(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> bool:
    """Equal batch sizes, and equal heads (with ``enable_gqa``: query heads a multiple of the key's and value's)."""
    if not query.size(0) == key.size(0) == value.size(0):
        return False
    heads, key_heads = query.size(1), key.size(1)
    if enable_gqa:
        return key_heads == value.size(1) and key_heads > 0 and heads % key_heads == 0
    return heads == key_heads == value.size(1)


class CudaKernels(TorchFunctionMode):
    """Dropout and attention calls on fake tensors, run as CUDA runs them; every other call as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: set[str] = set()
        """The CUDA kernels run in place of the device's own (``native_dropout``, ``flash attention``...)."""
        self._multi_head: Callable[..., Any] | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        routed: tuple[Tensor, str] | None = None
        if func is F.multi_head_attention_forward:
            return self._multi_head_attention()(*args, **kwargs)
        if func is Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            call = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
            call.apply_defaults()
            routed = _attention_as_on_cuda(**call.arguments)
        elif func is F.dropout or func is torch.dropout:
            call = (_FUNCTIONAL_DROPOUT if func is F.dropout else _TORCH_DROPOUT).bind(*args, **kwargs)
            call.apply_defaults()
            input, p, training, *inplace = call.arguments.values()
            routed = _dropout_as_on_cuda(input, p, training, inplace=bool(inplace and inplace[0]))
        if routed is None:
            return func(*args, **kwargs)
        output, kernel = routed
        self.kernels.add(kernel)
        return output

    def _multi_head_attention(self) -> Callable[..., Any]:
        """``F.multi_head_attention_forward`` whose own attention and dropout calls come to this mode.

        A mode sees no call made inside a call it handles (torch takes it off the stack meanwhile), and
        ``nn.MultiheadAttention`` (``nn.TransformerEncoderLayer``...) calls attention from inside this function: the
        copy runs the function's code with those two names bound to this mode's routing, in globals of its own
        (torch's module is left as it is).
        """
        if self._multi_head is None:
            function = F.multi_head_attention_forward
            names = dict(vars(F))
            names["scaled_dot_product_attention"] = self._routing(F.scaled_dot_product_attention)
            names["dropout"] = self._routing(F.dropout)
            copy = FunctionType(function.__code__, names, function.__name__, function.__defaults__)
            copy.__kwdefaults__ = function.__kwdefaults__
            self._multi_head = copy
        return self._multi_head

    def _backward(self, func: Any, args: Any, kwargs: Any) -> None:
        """``Tensor.backward`` or ``torch.autograd.backward`` run by autograd's engine with this mode on the stack.

        torch takes a mode off its stack while the mode handles a call, and backward is such a call: the engine ran
        without this mode, so a block checkpointed in the replay recomputed with the CPU's attention and dropout where
        its forward had run CUDA's (non-reentrant checkpointing raised ``CheckpointError``, "Number of tensors saved
        during forward: 31 ... during recomputation: 30", for a GPT-2 with SDPA; reentrant checkpointing counted the
        CPU's kernels in backward). The engine is entered here as ``torch.autograd.backward`` enters it, with this mode
        pushed again. A call this does not take apart (gradient edges, ``inputs`` by name, ``grad_variables``), or a
        torch without the engine's entry, runs as the function runs it.
        """
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        make_grads = getattr(torch.autograd, "_make_grads", None)
        as_tuple = getattr(torch.autograd, "_tensor_or_tensors_to_tuple", None)
        if func is Tensor.backward:
            call = _TENSOR_BACKWARD.bind(*args, **kwargs)
            call.apply_defaults()
            tensors, gradients, retain, create, inputs = call.arguments.values()
        else:
            call = _AUTOGRAD_BACKWARD.bind(*args, **kwargs)
            call.apply_defaults()
            tensors, gradients, retain, create, old_gradients, inputs = call.arguments.values()
            if old_gradients is not None:
                engine = None
        tensors = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
        named = inputs is not None and not isinstance(inputs, tuple | list | Tensor)  # by name, or a gradient edge
        inputs = () if inputs is None or named else (inputs,) if isinstance(inputs, Tensor) else tuple(inputs) or None
        plain = not named and inputs is not None and all(isinstance(each, Tensor) for each in (*tensors, *inputs))
        if engine is None or make_grads is None or as_tuple is None or not plain:
            func(*args, **kwargs)
            return
        gradients = make_grads(tensors, as_tuple(gradients, len(tensors)), is_grads_batched=False)
        with self:
            engine.run_backward(
                tensors,
                gradients,
                create if retain is None else retain,
                create,
                inputs,
                allow_unreachable=True,
                accumulate_grad=True,
            )

    def _routing(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` as this mode runs it."""

        def routed(*args: Any, **kwargs: Any) -> Any:
            return self.__torch_function__(func, (), args, kwargs)

        return routed

    @property
    def notes(self) -> tuple[str, ...]:
        """What the replay says of the kernels it ran as CUDA does (nothing where it ran none)."""
        return (kernels_note(self.kernels),) if self.kernels else ()


_KERNELS_NOTE = "replayed with CUDA's kernels where this torch, without a CUDA device, runs others: "
_KERNELS_WHY = (
    " (attention as torch picks its kernel on a GPU of compute capability 8.0 or later; dropout saving a bool mask)"
)


def kernels_note(kernels: Iterable[str]) -> str:
    """The note saying which of CUDA's kernels a replay ran (:attr:`CudaKernels.notes`)."""
    return f"{_KERNELS_NOTE}{', '.join(sorted(set(kernels)))}{_KERNELS_WHY}"


def merged_kernel_notes(notes: Iterable[str]) -> tuple[str, ...]:
    """``notes`` with every replay's kernels note made one (each kernel once), where the first of them stood.

    Replays of one plan run other kernels (flash attention at bf16, memory-efficient at fp32): one note says all.

    >>> merged_kernel_notes(["a", kernels_note(["flash"]), kernels_note(["efficient", "flash"])])[1] == kernels_note(
    ...     ["efficient", "flash"]
    ... )
    True
    """
    notes = list(dict.fromkeys(notes))
    ran = [note for note in notes if note.startswith(_KERNELS_NOTE) and note.endswith(_KERNELS_WHY)]
    if len(ran) < 2:
        return tuple(notes)
    kernels = {kernel for note in ran for kernel in note[len(_KERNELS_NOTE) : -len(_KERNELS_WHY)].split(", ")}
    first = notes.index(ran[0])
    kept = [note for note in notes if note not in ran]
    return (*kept[:first], kernels_note(kernels), *kept[first:])


def _fake(*values: Any) -> bool:
    """Whether every tensor among ``values`` is a fake tensor (the replay's own): real ones are left alone."""
    return all(isinstance(value, FakeTensor) for value in values if isinstance(value, Tensor))


def _dropout_as_on_cuda(input: Any, p: float, training: bool, inplace: bool) -> tuple[Tensor, str] | None:
    """``native_dropout``'s output where CUDA's ``dropout`` runs it; ``None`` where CUDA takes the noise path too."""
    if inplace or not training or not isinstance(input, FakeTensor) or not 0 < p < 1 or input.numel() == 0:
        return None
    output: Tensor = torch.native_dropout(input, p, True)[0]
    return output, "native_dropout"


def _attention_as_on_cuda(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[Tensor, str] | None:
    """What CUDA's ``scaled_dot_product_attention`` returns, and its kernel; ``None`` for tensors not the replay's.

    As ``attention.cpp`` calls the kernels: under autocast (a lower-precision op on CUDA) the floating inputs are
    cast first; flash attention gets inputs padded to a head dimension that is a multiple of 8 and its output cut
    back; memory-efficient attention gets a ``bool`` mask as an additive one (``0`` and ``-inf`` in the inputs'
    dtype), padded where its strides are not aligned, expanded to (batch, heads, queries, keys), and computes the
    log-sum-exp only where a gradient will be asked for; the math path (``_scaled_dot_product_attention_math``) gets
    a ``bool`` mask as an additive one and runs without autocast (its ``float16``/``bfloat16`` inputs computed in
    ``float32``; grouped-query key and value heads repeated to the query's), where the CPU would run its own flash
    kernel on inputs it takes (no dropout), which saves no attention weights.
    """
    if not _fake(query, key, value, attn_mask):
        return None
    device = query.device.type
    if device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (_cast(tensor, dtype) for tensor in (query, key, value))
        attn_mask = None if attn_mask is None else _cast(attn_mask, dtype)
    backend = cuda_attention(query, key, value, attn_mask, is_causal, enable_gqa)
    if backend == SDPBackend.FLASH_ATTENTION:
        head_dim = query.size(-1)
        pad = -head_dim % FLASH_HEAD_DIM_ALIGNMENT
        padded = [F.pad(tensor, (0, pad)) if pad else tensor for tensor in (query, key, value)]
        scale = scale if scale is not None else 1 / math.sqrt(head_dim)
        flash = torch.ops.aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=scale)
        output: Tensor = flash[0]
        return (output[..., :head_dim] if pad else output), "flash attention"
    if backend == SDPBackend.EFFICIENT_ATTENTION:
        bias = None if attn_mask is None else _efficient_bias(attn_mask, query, key)
        log_sumexp = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value))
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, log_sumexp, dropout_p, is_causal, scale=scale
        )
        return efficient[0], "memory-efficient attention"
    bias = None if attn_mask is None or attn_mask.dtype != torch.bool else _additive(attn_mask, query.dtype)
    with torch.autocast(device, enabled=False) if device in AUTOCAST_DEVICES else contextlib.nullcontext():
        math_path = torch.ops.aten._scaled_dot_product_attention_math(
            query,
            key,
            value,
            attn_mask if bias is None else bias,
            dropout_p,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return math_path[0], "the math path"


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` as autocast casts an argument of a lower-precision op: ``float32`` (or another float) to ``dtype``."""
    if tensor.is_floating_point() and tensor.dtype != torch.float64 and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A ``bool`` mask as an additive one of ``dtype`` (``convert_boolean_attn_mask``): 0 where true, else -inf."""
    return torch.full_like(mask, -math.inf, dtype=dtype).masked_fill_(mask, 0.0)


def _efficient_bias(mask: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """The additive mask memory-efficient attention receives (``convert_boolean_attn_mask``, ``preprocess_mask``)."""
    if mask.dtype == torch.bool:
        mask = _additive(mask, query.dtype)
    aligned = mask.stride(-1) == 1 and all(stride % MASK_ALIGNMENT == 0 for stride in mask.stride()[:-1])
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, MASK_ALIGNMENT - last % MASK_ALIGNMENT))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
