"""The CPU's measurement (``prediction/timing/host.py``) runs in the user's process: none of the user's modes sees it.

Found attacking the step-time prediction: the measurement (matrix products, a copy, a tiny training step, each
probed kind of op) ran under whatever the caller had active. A ``TorchFunctionMode`` or an op-counting
``TorchDispatchMode`` around ``fit`` (or around ``predict()``) counted its 3,223 torch calls and 4,817 ops, and a
pair of saved-tensor hooks packed 451 of its tensors. Each case measures under the user's mode and reads the
user's counts back, and the process's state before and after.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_vram.prediction.timing.host import measure_host


class CallCounter(TorchFunctionMode):
    """The user's torch-function mode: every torch function and tensor method it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch ships it without annotations
    """The user's dispatch mode: every op it sees."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def process_state(generator: torch.Generator) -> dict[str, Any]:
    """What the measurement could change in the process: threads, flags, modes, generators."""
    return {
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "anomaly": torch.is_anomaly_enabled(),
        "torch_rng": torch.get_rng_state(),
        "user_generator": generator.get_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].tobytes(),
    }


def test_the_users_modes_and_saved_tensor_hooks_see_none_of_the_measurement() -> None:
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.numel())
        return tensor

    generator = torch.Generator().manual_seed(3)
    before = process_state(generator)
    calls, ops = CallCounter(), OpCounter()
    with (
        torch.no_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        calls,
        ops,
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        peaks = measure_host(repeats=1)
        inside = process_state(generator)
    assert (calls.calls, ops.ops, len(packed)) == (0, 0, 0)
    assert peaks.fp32_flops > 0 and peaks.op_overhead_seconds > 0
    assert torch.equal(inside.pop("torch_rng"), before["torch_rng"])
    assert torch.equal(inside.pop("user_generator"), before["user_generator"])
    assert inside == {**{key: before[key] for key in inside}, "grad": False, "autocast": (True, torch.bfloat16)}
    after = process_state(generator)
    assert all(
        torch.equal(after[key], before[key]) if isinstance(before[key], torch.Tensor) else after[key] == before[key]
        for key in before
    )
