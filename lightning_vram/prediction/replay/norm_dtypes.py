"""The dtypes torch's normalisation kernels give a low-precision input with float32 weights, which fake tensors miss.

Under CPU autocast a GroupNorm, LayerNorm or BatchNorm runs on a ``bfloat16`` (or ``float16``) input with its
``float32`` weight: a mixed-type call. The real kernels keep such a call's statistics (mean, rstd) in the weight's
dtype and return GroupNorm's input gradient in the input's dtype; the fake kernels (torch's decompositions) give
statistics in the input's dtype, and a ``float32`` input gradient that autograd then casts back: a transient
``float32`` copy of every GroupNorm's input in backward (+5.7% of a small U-Net's backward live peak;
docs/measurement.md). :class:`MixedNormDtypes` sits just above the fake mode and hands on the real kernels' dtypes.
On CUDA the same rule is applied (not checked on a GPU): CUDA autocast runs GroupNorm and LayerNorm in ``float32``
(torch's autocast op lists), so there only a mixed-type BatchNorm's two per-channel statistics change.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vram.prediction.replay._fake import TorchDispatchMode

aten = torch.ops.aten

LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})
"""Input dtypes a mixed-type normalisation call has (its weight in ``float32``)."""

_FORWARD = {
    aten.native_group_norm.default: (1, 2),
    aten.native_layer_norm.default: (1, 2),
    aten.native_batch_norm.default: (1, 2),
    aten._native_batch_norm_legit.default: (1, 2),
}
"""Forward ops, with the indices of their outputs that are statistics (the input is argument 0, the weight 1 or 2)."""

_WEIGHT_ARGUMENT = {aten.native_layer_norm.default: 2}
"""Where the weight is not argument 1 (layer norm's argument 1 is the normalised shape)."""

_GROUP_NORM_BACKWARD = aten.native_group_norm_backward.default


def _mixed(tensor: Any, weight: Any) -> bool:
    """Whether a normalisation call is mixed-type: a low-precision input with a ``float32`` weight."""
    return (
        isinstance(tensor, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and tensor.dtype in LOW_PRECISION
        and weight.dtype == torch.float32
    )


# torch ships TorchDispatchMode without annotations.
class MixedNormDtypes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Mixed-type normalisation ops with the real kernels' output dtypes; every other op as the fake mode gives it.

    Enter it just inside the fake mode: the modes above it see the corrected outputs only.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        statistics = _FORWARD.get(func)
        if statistics is not None:
            if _mixed(args[0], args[_WEIGHT_ARGUMENT.get(func, 1)]):
                outputs = list(result)
                for index in statistics:
                    outputs[index] = torch.empty_like(outputs[index], dtype=torch.float32)
                return tuple(outputs)
        elif func is _GROUP_NORM_BACKWARD and _mixed(args[1], args[4]):
            grad_input, *rest = result
            if grad_input is not None and grad_input.dtype != args[1].dtype:
                return (torch.empty_like(grad_input, dtype=args[1].dtype), *rest)
        return result
