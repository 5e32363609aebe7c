"""isolated() puts the process-wide settings back when the code inside raises, and writes only those that changed."""

from __future__ import annotations

import decimal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from lightning_vram.prediction.containment.isolation import isolated


def settings() -> dict[str, Any]:
    return {
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "cudnn": tuple(getattr(torch.backends.cudnn, flag) for flag in ("enabled", "benchmark", "deterministic")),
        "matmul": torch.get_float32_matmul_precision(),
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "fp16 reduction": torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
        "recursion": sys.getrecursionlimit(),
        "decimal": (decimal.getcontext(), decimal.getcontext().prec, decimal.getcontext().traps[decimal.Inexact]),
        "modes": list(_get_current_function_mode_stack()),  # type: ignore[no-untyped-call]
        "device": torch.get_default_device(),
    }


@pytest.fixture
def kept() -> Iterator[dict[str, Any]]:
    before = settings()
    context = decimal.getcontext().copy()
    yield before
    torch.set_default_device(None)
    decimal.setcontext(context)


def change_everything_and_fail() -> None:
    """A step that changes every kept setting, then raises."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
    sys.setrecursionlimit(sys.getrecursionlimit() + 7)
    decimal.getcontext().prec += 3
    decimal.getcontext().traps[decimal.Inexact] = True
    decimal.setcontext(decimal.Context(prec=5))
    torch.set_default_device("meta")
    raise ValueError("the step failed")


def test_every_setting_is_put_back_when_the_code_inside_raises(kept: dict[str, Any]) -> None:
    torch.set_default_device("cpu")  # the user's, before the replay
    before = settings()
    with pytest.raises(ValueError, match="the step failed"), isolated():
        change_everything_and_fail()
    assert settings() == before
    assert torch.empty(1).device == torch.device("cpu")


def test_a_setting_left_as_it_was_is_not_written(monkeypatch: pytest.MonkeyPatch, kept: dict[str, Any]) -> None:
    written: list[str] = []
    for name in ("_set_cudnn_benchmark", "_set_float32_matmul_precision", "_set_fp32_precision_setter"):
        monkeypatch.setattr(torch._C, name, lambda *args, name=name: written.append(name))
    monkeypatch.setattr(sys, "setrecursionlimit", lambda limit: written.append("setrecursionlimit"))
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *args, **kwargs: written.append("deterministic"))
    with isolated():
        torch.zeros(2).sum()
    assert written == []
    assert settings() == kept
