"""Finds what ``torch.compile`` wrapped: modules (inside them, module hooks do not fire) and functions.

torch marks what it compiles with private names: the module wrapper's class
(``torch._dynamo.eval_frame.OptimizedModule``) and the attributes it sets on a compiled function's wrapper
(``_torchdynamo_orig_callable``, ``_torchdynamo_wrapper_id``; ``_torchdynamo_disable`` on a function
``torch.compiler.disable`` wrapped, which runs eagerly). This module is the only one that names them. The wrapper's
class is looked up among the modules already imported: until torch's dynamo is imported nothing can be compiled, and
an older or trimmed torch without it has nothing compiled either.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torch import nn

_ORIGINAL = "_torchdynamo_orig_callable"
_WRAPPER_ID = "_torchdynamo_wrapper_id"
_DISABLED = "_torchdynamo_disable"


def is_compiled_module(value: Any) -> bool:
    """Whether ``value`` is a module ``torch.compile`` wrapped (its ``_orig_mod`` is the module it runs)."""
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return wrapper is not None and isinstance(value, wrapper)


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place: its own hooks then run inside the compiled graph.

    Read from its ``__dict__`` (``_compiled_call_impl``), never running its code.
    """
    return vars(module).get("_compiled_call_impl") is not None


def _compiled_forward(module: nn.Module) -> bool:
    """Whether a compiled function was put in place of ``module.forward`` (its children run inside the graph)."""
    return compiled_callable_name(vars(module).get("forward")) is not None


def compiled_module_names(root: nn.Module) -> tuple[str, ...]:
    """Names (as ``named_modules`` gives them) of the modules compiled, wrapped or in place, outermost only."""
    names: list[str] = []
    for name, module in root.named_modules():
        # A root whose forward is compiled (a whole LightningModule compiled) is recognised from the step's code.
        compiled = is_compiled_module(module) or compiled_in_place(module) or (bool(name) and _compiled_forward(module))
        if compiled and not any(name.startswith(f"{outer}.") for outer in names):
            names.append(name)
    return tuple(names)


def compiled_callable_name(value: Any) -> str | None:
    """The name of what ``value`` runs compiled, when ``torch.compile`` made it; ``None`` otherwise.

    ``value`` is a compiled function's wrapper (``torch.compile(fn)``, ``@torch.compile``, ``torch.compile`` of a
    bound method) or a compiled module. Read through the function's own ``__dict__``, never a user's ``__getattr__``;
    a function that ``functools.wraps`` copied the marks onto is not the wrapper (torch's own check).

    >>> import torch
    >>> def gelu(x):
    ...     return x * torch.sigmoid(1.702 * x)
    >>> compiled_callable_name(torch.compile(gelu)), compiled_callable_name(gelu)
    ('gelu', None)
    >>> compiled_callable_name(torch.compiler.disable(gelu)) is None
    True
    """
    if isinstance(value, types.FunctionType):
        marks = vars(value)
        original = marks.get(_ORIGINAL)
        if original is None or marks.get(_WRAPPER_ID) != id(value) or marks.get(_DISABLED, False):
            return None
        if isinstance(original, (types.FunctionType, types.MethodType)):
            return original.__qualname__
        return type(original).__qualname__
    if is_compiled_module(value):
        return f"a compiled {type(value._orig_mod).__qualname__}"
    return None
