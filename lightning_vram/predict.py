"""What a training step would hold on a GPU, predicted without training and without the model's memory.

For a notebook or a laptop deciding which GPU to rent::

    from lightning_vram import predict

    prediction = predict(model, batch, precision="bf16-mixed")
    prediction.step.peak            # the highest phase: predicted allocator peak and its breakdown
    prediction.fit                  # the largest batch that fits each common GPU
    predict(model, batch, max_length=2048)  # the same for the longest sequence expected
    predict(model, images, max_shape=(3, 512, 512))  # or the largest shape: images of up to 512x512

The step is replayed under fake tensors (:mod:`lightning_vram.prediction.replay`): the model's own ``training_step``,
loss and ``configure_optimizers``, on the batch's shapes and dtypes, after one uncounted warm-up step so that
gradients and optimizer state exist as in every later step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_vram.advice.budget import plan_for_budget
from lightning_vram.advice.checkpoint_code import CodeContext
from lightning_vram.config import MAX_LENGTH, memory_budget_bytes, require_int, require_one_of, require_shape
from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.containment.escapes import round_of_replays
from lightning_vram.prediction.devices import COMMON_GPUS, DEFAULT_CUDA_CONTEXT_BYTES
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.batches import length_shape, reference_shape, resize_shape
from lightning_vram.prediction.replay.precision import PLANS
from lightning_vram.prediction.replay.reserved import run_settings
from lightning_vram.prediction.timing import GPU_PEAKS, predict_step_time
from lightning_vram.records import FitRow, Prediction, ReplayedStep, StepTime, TrainingLoop
from lightning_vram.records.budget import BudgetPlan


def predict(
    module: nn.Module,
    batch: Any,
    *,
    precision: str = "32-true",
    device_type: str = "cuda",
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES,
    fit_table: bool = True,
    budget_seconds: float = 60.0,
    max_length: int | None = None,
    max_shape: tuple[int, ...] | None = None,
    memory_budget: int | str | None = None,
) -> Prediction:
    """Predict one steady training step's memory, phase by phase, and the largest batch per common GPU.

    Nothing is trained and no tensor of the model's size is allocated; the module is left as it was.

    Args:
        module: a LightningModule (its ``training_step`` and ``configure_optimizers`` are used), on any device.
        batch: one batch as ``training_step`` receives it; only its shapes and dtypes matter.
        precision: the precision to train in, as Lightning names it, one a replay reproduces
            (:data:`REPLAYED_PRECISIONS`: ``"32-true"``, ``"bf16-mixed"``...).
        device_type: the device to predict for. Without a CUDA device, a CUDA build of torch replays the step on
            fake CUDA tensors (backward walked in Python, :mod:`~lightning_vram.prediction.replay.backward`); a
            CPU-only build cannot fake CUDA tensors: the step is replayed on the CPU then. Either way dropout and
            attention run as on a GPU (:mod:`~lightning_vram.prediction.replay.cuda_kernels`), and the prediction
            says so in its notes.
        cuda_context_bytes: memory the CUDA context and libraries take beside the tensors, kept free in the fit
            table.
        fit_table: also find the largest batch for each GPU of :data:`~lightning_vram.prediction.devices.COMMON_GPUS`
            (replays for all of them: lines on replayed peaks seed the search). For ``"cuda"`` a batch fits where
            the simulated caching allocator, with the environment's ``PYTORCH_ALLOC_CONF``, serves its whole step
            in the card's memory less ``cuda_context_bytes``; each row also gives the largest batch with
            ``expandable_segments:True``. For ``"cpu"``, where its tensor peak leaves 10% of the card free.
        budget_seconds: host seconds for all the replays: one running when they end stops at its next op, and the
            prediction says what the budget left out.
        max_length: predict for the batch resized to this length along its length dimension (dimension 1 of its
            first tensor with two or more: a language model's tokens), the longest the run expects; the resized
            batch is allocated where ``batch`` is (its values tiled along the length).
        max_shape: predict for the batch resized to this shape past its batch dimension, for its first tensor with
            two or more dimensions (``(3, 512, 512)`` for images batched as ``(B, 3, H, W)``): in every batch tensor,
            each dimension past the first whose size is one of that tensor's takes its new size (tiled, or cut),
            matched from the last dimension where two of its sizes are equal (an image and its mask). Not with
            ``max_length``.
        memory_budget: the memory the step may use, in bytes or as a string (``"20GiB"``, ``"512MB"``): the
            prediction's ``budget`` then holds the checkpointing plan with the least recomputed FLOPs whose replayed
            step fits it (:func:`~lightning_vram.advice.budget.plan_for_budget`: on CUDA the simulated caching
            allocator serves the step within it, elsewhere the replayed live peak is at or under it), with the code
            to write, or why no plan fits. Searched before the fit table, within ``budget_seconds``: with a fit
            table, within half of what is left after the baseline (:data:`BUDGET_SEARCH_SHARE`), the table the rest.

    Returns:
        The prediction, or one whose ``skipped`` says why the step could not be replayed.

    Raises:
        TypeError: ``module`` is not a LightningModule, or ``batch`` is None.
        ValueError: another argument is out of its range; the message names it, what it must be and what it got.
    """
    _check_arguments(module, precision, cuda_context_bytes, fit_table, budget_seconds)
    if batch is None:
        raise TypeError(
            "batch must be one batch as training_step receives it (a tensor, or a tuple, list or dict holding the"
            " batch's tensors: their shapes and dtypes are what is predicted), got None"
        )
    budget_bytes = memory_budget_bytes("memory_budget", memory_budget)
    shape = _expected_shape(batch, max_length, max_shape)
    if shape is not None:
        batch = resize_shape(batch, shape)
    device, notes = _replay_device(device_type)
    asked = device_type.split(":")[0]
    on_gpu = device.type == "cuda" and torch.cuda.is_available()  # fake CUDA without a device has no capability
    capability = torch.cuda.get_device_capability(device) if on_gpu else None
    # For a GPU, "fits" is the simulated caching allocator serving the step: its settings are the environment's.
    settings = run_settings() if device_type.startswith("cuda") else None
    if isinstance(settings, str):
        notes += (settings,)
    predictor = Predictor(
        module,
        None,
        batch,
        precision=precision,
        placement=device,
        warm_up=True,
        budget_seconds=budget_seconds,
        compute_capability=capability,
        allocator=settings if isinstance(settings, AllocatorSettings) else None,
        for_cuda=asked == "cuda",
    )
    with round_of_replays():
        step = predictor.replay(None, count_flops=True)
        if not isinstance(step, ReplayedStep):
            return Prediction(None, (), cuda_context_bytes, skipped=step.reason, notes=notes, device_type=asked)
        budget: BudgetPlan | None = None
        if budget_bytes is not None:
            context = CodeContext(TrainingLoop.LIGHTNING, type(module).__name__)
            left = predictor.seconds_left()
            if fit_table and left is not None and left > 0:  # the fit table keeps the rest
                share = left * BUDGET_SEARCH_SHARE
                predictor.budget_seconds = predictor.clock() - predictor.started + share
                notes += (
                    f"time budget: the memory budget's search may take up to {share:.1f} s ({BUDGET_SEARCH_SHARE:.0%}"
                    f" of the {left:.1f} s left after the baseline), the fit table what it leaves",
                )
            try:
                found = plan_for_budget(predictor, budget_bytes, step, context)
            finally:
                predictor.budget_seconds = budget_seconds
            if isinstance(found, str):
                notes += (f"memory budget: no plan searched: {found}",)
            else:
                budget = found
        rows: tuple[FitRow, ...] = ()
        if fit_table:
            if budget_bytes is not None and (left := predictor.seconds_left()) is not None:
                notes += (f"time budget: the fit table may take up to {max(left, 0.0):.1f} s of {budget_seconds} s",)
            search = predictor.fit_table(
                cuda_context_bytes, known_steps={step.batch_size: step} if step.batch_size is not None else None
            )
            rows = search.found
            if search.missing is not None:
                budget_note = f" (time budget {budget_seconds} s)" if search.replays else ""
                notes += (f"fit table incomplete: {search.missing}{budget_note}",)
            notes += tuple(f"fit table: {note}" for note in search.notes)
        times = _step_times(step, rows) if device_type.startswith("cuda") else ()
        return Prediction(
            step,
            rows,
            cuda_context_bytes,
            notes=notes + step.notes,
            budget=budget,
            step_times=times,
            device_type=asked,
        )


def _step_times(step: ReplayedStep, rows: tuple[FitRow, ...]) -> tuple[StepTime, ...]:
    """The step's predicted time on each card of the fit table's rows (every card of GPU_PEAKS without rows).

    A roofline per op at the card's published peaks (:func:`~lightning_vram.prediction.timing.predict_step_time`),
    at the replayed batch, uncalibrated: nothing measured it.
    """
    if step.work is None:
        return ()
    devices = {row.device for row in rows}
    return tuple(
        predict_step_time(step, peaks) for peaks in GPU_PEAKS.values() if not devices or peaks.memory_row in devices
    )


BUDGET_SEARCH_SHARE = 0.5
"""The share of the seconds left after the baseline that a memory budget's search may take where a fit table
follows it: the table keeps the rest (a search given it all left the table empty)."""

REPLAYED_PRECISIONS = ("32-true", "32", *PLANS, "64")
"""The precisions a replay reproduces, as Lightning names them (``"32"`` and ``"64"``: its short forms)."""


def _check_arguments(
    module: object, precision: object, cuda_context_bytes: object, fit_table: object, budget_seconds: object
) -> None:
    """Refuse a bad argument of :func:`predict` with a ValueError naming it, what it must be and what it got.

    A ``module`` that is not one is a TypeError. ``cuda_context_bytes`` is at most the largest card of the fit table:
    a context that leaves no card any memory predicts nothing.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module (a LightningModule), got {type(module).__name__}")
    missing = [name for name in ("training_step", "configure_optimizers") if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            "module must be a LightningModule (predict() replays its training_step with the optimizers its"
            f" configure_optimizers returns), got {type(module).__name__}, which has no {' and no '.join(missing)};"
            " a plain nn.Module is measured and replayed in its own loop by VramSession.start(..., step_function=...)"
        )
    if precision not in REPLAYED_PRECISIONS or not isinstance(precision, str):
        raise ValueError(f"precision must be one of {', '.join(REPLAYED_PRECISIONS)}, got {_shown(precision)}")
    largest = max(memory for _, memory in COMMON_GPUS)
    if isinstance(cuda_context_bytes, bool) or not isinstance(cuda_context_bytes, int):
        raise ValueError(f"cuda_context_bytes must be an int >= 0, got {_shown(cuda_context_bytes)}")
    if not 0 <= cuda_context_bytes <= largest:
        raise ValueError(
            f"cuda_context_bytes must be an int >= 0 and at most the largest GPU's memory ({largest}),"
            f" got {cuda_context_bytes!r}"
        )
    if not isinstance(fit_table, bool):
        raise ValueError(f"fit_table must be True or False, got {_shown(fit_table)}")
    if isinstance(budget_seconds, bool) or not isinstance(budget_seconds, (int, float)):
        raise ValueError(f"budget_seconds must be a number of seconds > 0, got {_shown(budget_seconds)}")
    if not 0 < budget_seconds < math.inf:  # NaN fails too
        raise ValueError(f"budget_seconds must be a number of seconds > 0, finite, got {budget_seconds!r}")


def _shown(value: object) -> str:
    """A value as an error message shows it: its repr and its type (``'no' (str)``)."""
    return f"{value!r} ({type(value).__name__})"


def _expected_shape(batch: Any, max_length: int | None, max_shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The shape past the batch dimension ``max_length`` or ``max_shape`` asks for (``None``: neither); checked."""
    require_int("max_length", max_length, 1, MAX_LENGTH, allow_none=True)
    require_shape("max_shape", max_shape)
    require_one_of("max_length", max_length, "max_shape", max_shape)
    if max_length is None and max_shape is None:
        return None
    old = reference_shape(batch)
    if old is None:
        if max_shape is None:
            raise ValueError("max_length needs a batch with a tensor of two or more dimensions (its length is dim 1)")
        raise ValueError("max_shape needs a batch with a tensor of two or more dimensions (its sizes past dim 0)")
    if max_length is not None:
        return length_shape(batch, max_length)
    if max_shape is not None and len(max_shape) != len(old):
        raise ValueError(
            "max_shape must have a size per dimension past the batch's of its first tensor with two or more"
            f" ({len(old)}: {old}), got {max_shape!r}"
        )
    return max_shape


FAKE_CUDA_NOTE = (
    "replayed on fake CUDA tensors without a CUDA device (this torch is a CUDA build): backward walked the autograd"
    " graph in Python, where hooks on tensors and autograd nodes do not run"
)
"""The note of a prediction for CUDA made on a machine without one, by a CUDA build of torch."""


def _replay_device(device_type: str) -> tuple[torch.device, tuple[str, ...]]:
    """The device to replay on for ``device_type``, and a note where it is another one."""
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cuda' or 'cpu', got {type(device_type).__name__}")
    if device_type.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    try:
        device = torch.device(device_type)
    except RuntimeError:  # torch's "Invalid device string": a bad index
        raise ValueError(
            f"device_type must be 'cuda' or 'cpu' (with an index: 'cuda:1'), got {device_type!r}"
        ) from None
    cuda_build: bool = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]  # torch ships it unannotated
    if device.type == "cuda" and not torch.cuda.is_available() and cuda_build:
        return device, (FAKE_CUDA_NOTE,)
    if device.type == "cuda" and not torch.cuda.is_available():
        note = (
            "replayed on the CPU: without a CUDA device torch cannot fake CUDA tensors; parts and peaks are the"
            " CPU kernels' but dropout's and attention's, replayed as CUDA runs them (other CUDA kernels may save"
            " other tensors), the optimizer's path as on CUDA; cuBLAS's and cuBLASLt's workspaces are not counted (on"
            " an H100, two of 32 MiB and one of 1 MiB)"
        )
        return torch.device("cpu"), (note,)
    return device, ()
