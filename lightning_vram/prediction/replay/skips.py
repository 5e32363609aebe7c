"""Why a replay could not run, in words a user can act on."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from lightning_vram.prediction.containment.collectives import CollectiveError
from lightning_vram.prediction.containment.deadline import ReplayDeadlineError
from lightning_vram.prediction.replay._fake import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
)
from lightning_vram.prediction.replay.unit_calls import PlanChangesModelError


def skip_reason(error: BaseException) -> str:
    """The reason a replay stopped at ``error``, naming what fake tensors cannot do where that was the cause."""
    text = f"{type(error).__name__}: {error}".strip()
    if isinstance(error, (ReplayDeadlineError, CollectiveError, PlanChangesModelError)):
        return str(error)
    if isinstance(error, DataDependentOutputException):
        return (
            "the step reads a tensor's value (.item(), bool(), a Python condition on a tensor); fake tensors have"
            f" shapes but no values ({text}). A value read for logging can stay a tensor in the step"
            " (self.log takes tensors; keep loss.detach() and read it after the step) and the step is replayed"
        )
    if isinstance(error, DynamicOutputShapeException):
        return f"an op's output shape depends on the data (nonzero, masked_select, unique...): {text}"
    if isinstance(error, UnsupportedFakeTensorException):
        return f"an op cannot run on fake tensors (a custom kernel, a quantized or sparse tensor): {text}"
    if "not attached to a `Trainer`" in str(error):
        return f"the step reads self.trainer, which a replay does not attach: {text}"
    return f"the step failed under fake tensors: {text}"


ANOMALY_NOTE = (
    "autograd's anomaly detection (torch.autograd.detect_anomaly, Trainer(detect_anomaly=True)) was on: the replay"
    " ran without it, since it checks every backward result for NaN and fake tensors have no values; it keeps no"
    " tensors, so the memory counted is the same"
)


def profiler_recording() -> bool:
    """Whether torch's profiler records ops now (``torch.profiler.profile``, Lightning's ``profiler="pytorch"``)."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


PROFILER_SKIP = (
    "the PyTorch profiler is recording (torch.profiler.profile around the step, or Lightning's"
    ' profiler="pytorch"): a replay\'s operations would show up in its trace as if training ran them, so the step'
    " is not replayed while it records"
)


def closure_refusal(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """Why an optimizer whose ``step`` must be given a closure rules the replay out; ``None`` when none does.

    Such an optimizer (LBFGS, a SAM-style one) runs the loss and backward again inside its step as often as it
    decides; the replay runs the step's forward, backward and optimizer update once each.
    """
    for optimizer in optimizers:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            name = type(optimizer).__name__
            limit = optimizer.param_groups[0].get("max_iter") if optimizer.param_groups else None
            repeats = f" up to max_iter={limit} times" if limit is not None else ""
            return (
                f"{name} re-evaluates the loss through its closure{repeats} within each optimizer step, and the replay"
                " runs one forward, backward and update per step: it cannot follow the optimizer's own loop, so the"
                " step is not replayed"
            )
    return None


def sparse_refusal(module: nn.Module) -> str | None:
    """Why an embedding with sparse gradients rules the replay out; ``None`` when the module has none."""
    sparse = [
        name or "the model"
        for name, child in module.named_modules()
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
    ]
    if not sparse:
        return None
    return (
        f"{', '.join(sparse)} {'is an embedding' if len(sparse) == 1 else 'are embeddings'} with sparse=True: its"
        " gradient is a sparse tensor, which the replay's fake tensors cannot stand in for, so the step is not"
        " replayed"
    )
