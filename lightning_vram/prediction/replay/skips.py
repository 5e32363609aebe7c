"""Why a replay could not run, in words a user can act on."""

from __future__ import annotations

from lightning_vram.prediction.containment.deadline import ReplayDeadlineError
from lightning_vram.prediction.replay._fake import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
)


def skip_reason(error: BaseException) -> str:
    """The reason a replay stopped at ``error``, naming what fake tensors cannot do where that was the cause."""
    text = f"{type(error).__name__}: {error}".strip()
    if isinstance(error, ReplayDeadlineError):
        return str(error)
    if isinstance(error, DataDependentOutputException):
        return (
            "the step reads a tensor's value (.item(), bool(), a Python condition on a tensor); fake tensors have"
            f" shapes but no values ({text})"
        )
    if isinstance(error, DynamicOutputShapeException):
        return f"an op's output shape depends on the data (nonzero, masked_select, unique...): {text}"
    if isinstance(error, UnsupportedFakeTensorException):
        return f"an op cannot run on fake tensors (a custom kernel, a quantized or sparse tensor): {text}"
    if "not attached to a `Trainer`" in str(error):
        return f"the step reads self.trainer, which a replay does not attach: {text}"
    return f"the step failed under fake tensors: {text}"
