"""What activation checkpointing itself adds to each recomputed op on this CPU, measured once a process.

The step-time model prices a recomputed op like any other (its roofline and the cost of an op), but checkpointing
does work of its own around each: non-reentrant checkpointing's saved-tensor hooks pack what forward saves and
unpack it as backward recomputes, and selective checkpointing (``create_selective_checkpoint_contexts``) runs each
op of its units, in forward and again in recompute, through a Python dispatch mode that caches or looks up its
output. On one core of a CPU where an op cost 2.4 us (the model's figure), a chain of small elementwise ops took
12 us more an op checkpointed whole and 31 us more selectively than trained plain: selective checkpointing's ops
count no FLOPs and move few bytes, and this is most of their time.

Measured on a chain of :data:`CHAIN_OPS` ``sin`` ops on a small tensor (their kernels next to nothing), trained plain,
checkpointed whole and selectively (nothing kept); each figure is the extra seconds an op over the plain chain less
the cost of an op the model already counts for the recomputed op, the median of :data:`REPEATS` runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_vram.prediction.containment.installed import installed_user_code
from lightning_vram.prediction.timing.host import isolated_measurement

CHAIN_OPS = 100
"""Ops in the measured chain."""
REPEATS = 5
"""Timed repeats of each variant, after one untimed warm-up; the median is kept."""


@dataclass(frozen=True)
class CheckpointOverhead:
    """Seconds checkpointing adds to each op it recomputes, beyond the op: ``whole`` units and ``selective`` ones."""

    whole: float
    selective: float


_MEASURED: list[CheckpointOverhead] = []
"""This process's measurement (:func:`measure_checkpoint_overhead`)."""


def measure_checkpoint_overhead(op_seconds: float) -> CheckpointOverhead | None:
    """The CPU's checkpointing overhead an op, measured once a process; ``op_seconds``: the cost of an op it counts.

    Each figure is at least 0. ``None``, nothing measured, while a function of the user's is installed in torch's or
    Python's namespaces, as for :func:`~lightning_vram.prediction.timing.host.measure_host_peaks`.
    """
    if not _MEASURED:
        if installed_user_code():
            return None
        with isolated_measurement():
            plain, whole, selective = (_seconds_an_op(run) for run in (_plain, _whole, _selective))
        _MEASURED.append(
            CheckpointOverhead(max(whole - plain - op_seconds, 0.0), max(selective - plain - op_seconds, 0.0))
        )
    return _MEASURED[0]


def _chain(tensor: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPS):
        tensor = torch.sin(tensor)
    return tensor


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return _chain(tensor)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return checkpoint(_chain, tensor, use_reentrant=False)  # type: ignore[no-any-return]


def _recompute_all(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(tensor: torch.Tensor) -> torch.Tensor:
    def contexts() -> Any:
        return create_selective_checkpoint_contexts(_recompute_all)  # type: ignore[no-untyped-call]

    return checkpoint(_chain, tensor, use_reentrant=False, context_fn=contexts)  # type: ignore[no-any-return]


def _seconds_an_op(run: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The median seconds of ``run``'s forward and backward over the chain, an op."""
    leaf = torch.ones(16, requires_grad=True)
    times = []
    for repeat in range(REPEATS + 1):
        start = time.perf_counter()
        torch.autograd.backward(run(leaf).sum())
        if repeat:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / CHAIN_OPS
