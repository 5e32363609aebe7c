"""What ``torch.compile`` made, found by the walk from the step's code without calling it (nothing compiles here)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lightning_vram.measure.compiled import compiled_callable_name
from lightning_vram.prediction.containment.code_roots import code_roots, data_roots, inside_ids, instance_roots
from lightning_vram.prediction.containment.reach import Reach, reach_of


def gelu(inputs: torch.Tensor) -> torch.Tensor:
    return inputs * torch.sigmoid(1.702 * inputs)


def swish(inputs: torch.Tensor) -> torch.Tensor:
    return inputs * torch.sigmoid(inputs)


COMPILED_GELU = torch.compile(gelu)
COMPILED_HEAD = torch.compile(nn.Linear(4, 4))
EAGER_SWISH = torch.compiler.disable(swish)


@torch.compile
def decorated(inputs: torch.Tensor) -> torch.Tensor:
    return inputs.tanh()


def closes_over() -> Any:
    compiled = torch.compile(swish)
    return lambda module, batch: compiled(module(batch)).sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)


class UsesAGlobal(Net):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return COMPILED_GELU(self.linear(inputs))


class UsesADecoratedFunction(Net):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return decorated(self.linear(inputs))


class HasACompiledMethod(Net):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(inputs))

    @torch.compile
    def activation(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.relu()


class HasAnUncalledCompiledMethod(Net):
    """``activation`` is compiled, but nothing a training step runs calls it."""

    @torch.compile
    def activation(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.relu()


class UsesAGlobalCompiledModule(Net):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return COMPILED_HEAD(self.linear(inputs))


class UsesADisabledFunction(Net):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return EAGER_SWISH(self.linear(inputs))


def walk(module: nn.Module, step_function: Any = None) -> Reach:
    """The walk a sampled step makes: the code, what the module's instances hold, and their data."""
    roots = [*code_roots(module, step_function), *instance_roots(module)]
    return reach_of(roots, inside_ids(module), data_roots(module))


def test_the_wrappers_torch_compile_makes_are_named_by_what_they_run() -> None:
    net = Net()

    @functools.wraps(COMPILED_GELU)
    def copies_the_marks(inputs: torch.Tensor) -> torch.Tensor:
        return COMPILED_GELU(inputs)

    assert compiled_callable_name(COMPILED_GELU) == "gelu"
    assert compiled_callable_name(decorated) == "decorated"
    assert compiled_callable_name(torch.compile(net.forward)) == "Net.forward"
    assert compiled_callable_name(COMPILED_HEAD) == "a compiled Linear"
    assert compiled_callable_name(gelu) is None
    assert compiled_callable_name(EAGER_SWISH) is None  # torch.compiler.disable runs it eagerly
    assert compiled_callable_name(copies_the_marks) is None  # its marks are copies; the wrapper it calls is found
    assert compiled_callable_name(net) is None


def test_the_walk_finds_a_compiled_function_a_global_a_decorator_or_a_class_attribute_holds() -> None:
    assert walk(UsesAGlobal()).compiled == ["gelu (UsesAGlobal.forward: global COMPILED_GELU)"]
    assert walk(UsesADecoratedFunction()).compiled == ["decorated (UsesADecoratedFunction.forward: global decorated)"]
    assert walk(HasACompiledMethod()).compiled == ["HasACompiledMethod.activation (HasACompiledMethod.activation)"]
    assert walk(HasAnUncalledCompiledMethod()).compiled == []


def test_the_walk_finds_a_compiled_module_held_outside_the_model_but_not_one_inside_it() -> None:
    assert walk(UsesAGlobalCompiledModule()).compiled == [
        "a compiled Linear (UsesAGlobalCompiledModule.forward: global COMPILED_HEAD)"
    ]
    wrapped = Net()
    wrapped.linear = torch.compile(nn.Linear(4, 4))  # type: ignore[assignment]  # the sampled step's own case
    assert walk(wrapped).compiled == []


def test_the_walk_finds_compiled_functions_the_module_holds_and_a_step_function_closes_over() -> None:
    held = Net()
    held.activation = torch.compile(swish)
    held.table = {"act": torch.compile(gelu)}
    assert walk(held).compiled == ["swish (the model.activation)", "gelu (the model.table['act'])"]
    assert walk(Net(), closes_over()).compiled == ["swish (closes_over.<locals>.<lambda>: closure compiled)"]


def test_a_disabled_function_is_not_compiled_code() -> None:
    assert walk(UsesADisabledFunction()).compiled == []
