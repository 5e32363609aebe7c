"""Why a replay could not run, in words a user can act on."""

from __future__ import annotations

import inspect
import sysconfig
import traceback
from collections.abc import Sequence
from pathlib import Path

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
from lightning_vram.records import Phase

DISPATCH_FILES = (
    "torch/_ops.py",
    "torch/_compile.py",
    "torch/_subclasses/",
    "torch/_dynamo/",
    "torch/utils/_stats.py",
    "torch/utils/_python_dispatch.py",
)
"""torch's op dispatch: a read's traceback runs from the code that read the value into these (and into the
``__torch_dispatch__`` of the replay's modes), where the fake tensor raises."""
TENSOR_METHODS = "torch/_tensor.py"
"""The Python methods of ``Tensor`` (``__format__``, ``backward``): the code that called them is where a read is."""
CUSTOM_OPS = "torch/_library/"
"""torch's machinery for custom ops (``torch.library.custom_op``'s ``__call__``, its autograd's ``backward``): the
code that called the op, or the backward formula the user registered, is where it failed (a custom op with no fake
kernel was said to fail at ``torch/_library/custom_ops.py:863 (__call__)``, for every such op and caller)."""
PACKAGE = Path(__file__).resolve().parents[2]
"""This package's directory: its frames run the replay, they are never where the user's step read a value."""
LIBRARIES = tuple(
    Path(path).resolve() for path in {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")}
)
"""Where installed libraries and Python's own modules live: a frame anywhere else is the user's code."""
PHASE_WORDS = {Phase.FORWARD: "in forward", Phase.BACKWARD: "in backward", Phase.OPTIMIZER: "in the optimizer step"}


def _within(path: Path, directory: Path) -> bool:
    """Whether ``path`` lies under ``directory``."""
    return path.is_relative_to(directory)


def read_site(error: BaseException) -> tuple[str, bool] | None:
    """Where the code that ``error``'s op was called from is, ``file:line (function)``, and whether it is the user's.

    The innermost frame of ``error``'s traceback before torch's dispatch (:data:`DISPATCH_FILES`, a
    ``__torch_dispatch__``) that is neither this package's, a ``Tensor`` method's nor a custom op's machinery's
    (:data:`CUSTOM_OPS`); a library's file is named from
    its install directory (``torch/optim/_adafactor.py``), the user's as Python gave it. ``None`` when no frame is.
    """
    site: tuple[str, bool] | None = None
    for frame in traceback.extract_tb(error.__traceback__):
        name = frame.filename.replace("\\", "/")
        if frame.name == "__torch_dispatch__" or any(part in name for part in DISPATCH_FILES):
            break
        path = Path(frame.filename).resolve()
        if _within(path, PACKAGE) or name.endswith(TENSOR_METHODS) or CUSTOM_OPS in name:
            continue
        library = next((directory for directory in LIBRARIES if _within(path, directory)), None)
        shown = path.relative_to(library).as_posix() if library is not None else frame.filename
        site = (f"{shown}:{frame.lineno} ({frame.name})", library is None)
    return site


def _value_read(error: BaseException, text: str, phase: Phase | None) -> str:
    """Why a step that read a tensor's value is not replayed: where it read it, and the fix where it is the user's."""
    site = read_site(error)
    where = "".join(
        f" {part}" for part in (PHASE_WORDS[phase] if phase is not None else "", site and f"at {site[0]}") if part
    )
    read = f"the step reads a tensor's value (.item(), bool(), a Python condition on a tensor){where}"
    if site is not None and not site[1]:
        return (
            f"{read}, in library code the step calls; fake tensors have shapes but no values ({text}): the replay"
            " cannot follow it, so the step is not replayed"
        )
    return (
        f"{read}; fake tensors have shapes but no values ({text}). A value read for logging can stay a tensor in the"
        " step (self.log takes tensors; keep loss.detach() and read it after the step) and the step is replayed"
    )


def skip_reason(error: BaseException, phase: Phase | None = None) -> str:
    """The reason a replay stopped at ``error``, naming what fake tensors cannot do where that was the cause.

    ``phase``: the step's phase when it raised (``None``: before its forward). A value read says where it was made
    (:func:`read_site`) and offers the logging fix only where the user's own code read it.
    """
    text = f"{type(error).__name__}: {error}".strip()
    if isinstance(error, (ReplayDeadlineError, CollectiveError, PlanChangesModelError)):
        return str(error)
    if isinstance(error, DataDependentOutputException):
        return _value_read(error, text, phase)
    if isinstance(error, DynamicOutputShapeException):
        return f"an op's output shape depends on the data (nonzero, masked_select, unique...): {text}"
    if isinstance(error, UnsupportedFakeTensorException):
        return f"an op cannot run on fake tensors (a custom kernel, a quantized or sparse tensor): {text}"
    if "not attached to a `Trainer`" in str(error):
        return f"the step reads self.trainer, which a replay does not attach: {text}"
    site = read_site(error)
    if site is None:
        return f"the step failed under fake tensors: {text}"
    return f"the step failed under fake tensors at {site[0]}: {text}"


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
