"""Which of the user's code sits in torch's and Python's namespaces (``prediction/containment/installed.py``).

Every form a user installs a function in: itself, a ``functools.partial``, a library decorator's wrapper
(``__wrapped__``), a wrapper closing over it, a callable object, a method of a library class; none found in a
process where nothing is installed; what was put back is no longer found, and a new function at the same place is.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from installed_values import installed
from torch import nn

from lightning_vram.prediction.containment.installed import Installed, installed_refusal, installed_user_code
from lightning_vram.prediction.containment.user_code import is_user_file

HERE = Path(__file__).name


def linear(*args: Any, **kwargs: Any) -> Any:
    return F.linear(*args, **kwargs)


def line(function: Callable[..., Any]) -> int:
    return function.__code__.co_firstlineno


class Counter:
    """A callable object of the user's."""

    def __call__(self, *args: Any) -> None:
        return None


def library_wrapper(function: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper whose code is a library's (compiled as torch's file), closing over ``function`` without
    ``functools.wraps``: as some libraries' decorators make."""
    outer = compile("lambda function: lambda *args: function(*args)", torch.__file__, "eval")
    wrapper: Callable[..., Any] = eval(outer, {})(function)  # code of our own, named as torch's
    return wrapper


def test_nothing_is_found_where_nothing_is_installed() -> None:
    assert installed_user_code() == []
    assert installed_user_code([nn.Linear, nn.Conv2d, torch.optim.SGD, torch.optim.AdamW, pl.LightningModule]) == []


def test_a_function_and_what_wraps_it_are_found_in_each_form() -> None:
    def helper(*args: Any) -> Any:
        return torch.relu(*args)

    forms: dict[str, Any] = {
        "relu": helper,
        "tanh": functools.partial(helper),
        "sigmoid": torch.no_grad()(helper),  # torch's wrapper: functools.wraps sets __wrapped__
        "abs": functools.lru_cache(helper),  # C's wrapper, with __wrapped__ in its own dict
        "exp": Counter(),
        "log": Counter().__call__,
    }
    with contextlib.ExitStack() as stack:
        for name, value in forms.items():
            stack.enter_context(installed(torch, name, value))
        found = {entry.place: entry.what for entry in installed_user_code()}
    at = f"({HERE}:{line(helper)})"
    assert found == {
        "torch.relu": f"your function helper {at}",
        "torch.tanh": f"your function helper {at}",
        "torch.sigmoid": f"your function helper {at}",
        "torch.abs": f"your function helper {at}",
        "torch.exp": f"an object of your class Counter ({HERE}:{line(Counter.__call__)})",
        "torch.log": f"your function Counter.__call__ ({HERE}:{line(Counter.__call__)})",
    }
    assert installed_user_code() == []


def test_methods_of_torchs_classes_and_of_the_classes_a_walk_passes() -> None:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return None

    wrapped = functools.wraps(nn.Module.__call__)(call)  # named Module._wrapped_call_impl: its code says "call"
    with installed(torch.Tensor, "relu", functools.partialmethod(call)):
        assert [entry.place for entry in installed_user_code()] == ["torch.Tensor.relu"]
    with installed(nn.Module, "__call__", wrapped), installed(nn.Linear, "forward", linear):
        assert [str(entry) for entry in installed_user_code()] == [
            f"torch.nn.Module.__call__ is your function call ({HERE}:{line(call)})"
        ]
        assert [entry.place for entry in installed_user_code([nn.Linear])] == [
            "torch.nn.Module.__call__",
            "torch.nn.modules.linear.Linear.forward",
        ]


def test_builtins_and_the_interpreters_last_result() -> None:
    with installed(builtins, "_", linear):  # what a REPL holds of its last expression: no library calls it
        assert installed_user_code() == []
        with installed(builtins, "print", linear):
            assert [entry.place for entry in installed_user_code()] == ["builtins.print"]


def test_a_library_wrapper_closing_over_the_function_and_code_of_exec_are_found() -> None:
    wrapper = library_wrapper(linear)
    assert not is_user_file(wrapper.__code__.co_filename)
    with installed(F, "gelu", wrapper):
        assert [str(entry) for entry in installed_user_code()] == [
            f"torch.nn.functional.gelu is your function linear ({HERE}:{line(linear)})"
        ]
    with installed(F, "gelu", library_wrapper(torch.relu)):  # a library's wrapper of a library's function
        assert installed_user_code() == []
    with installed(F, "gelu", eval("lambda *args: None")):  # source run by exec: "<string>", the user's
        assert [str(entry) for entry in installed_user_code()] == [
            "torch.nn.functional.gelu is your function <lambda> (<string>:1)"
        ]


def test_put_back_is_not_found_and_a_new_function_in_its_place_is() -> None:
    for _ in range(3):  # each function made anew: one freed may leave its id to the next
        with installed(F, "linear", eval("lambda *args: None")):  # made anew each time
            assert [entry.place for entry in installed_user_code()] == ["torch.nn.functional.linear"]
        assert installed_user_code() == []


def test_the_reason_names_three_places_and_counts_the_rest() -> None:
    found = [Installed(f"torch.f{index}", "your function f (x.py:1)") for index in range(5)]
    reason = installed_refusal(found)
    assert reason is not None
    assert reason.startswith(
        "torch.f0 is your function f (x.py:1); torch.f1 is your function f (x.py:1); torch.f2 is your function f"
        " (x.py:1) (and 2 more): a replay would call it again."
    )
    assert installed_refusal([]) is None


class Scaled(nn.Module):
    """The user's module: its class is the base of the one a parametrization makes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * self.weight


class Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


def test_a_librarys_made_methods_and_its_classes_over_the_users_are_not_the_users() -> None:
    """Libraries make methods by ``exec``, from ``"<string>"`` as the user's ``exec`` does (a dataclass's ``__init__``,
    ``__repr__`` and ``__hash__``, a named tuple's ``__new__``); a parametrized module's class is torch's, made over the
    user's class, whose own methods the walk walks. 9,548 library classes (torch, Lightning, transformers with GPT-2 and
    Llama, NumPy, the standard library's) had 273 such methods: none is found."""
    from torch._guards import Source  # a dataclass with a made __hash__

    from lightning_vram.records.advice import Advice  # a dataclass: this package's own

    module = Scaled()
    nn.utils.parametrize.register_parametrization(module, "weight", Doubled())
    made = type(module)
    assert made is not Scaled and Scaled in made.__mro__
    assert installed_user_code([Advice, Source, functools._CacheInfo, made]) == []
