"""Finds modules wrapped by ``torch.compile``: inside them, module hooks do not fire.

torch's wrapper class (``torch._dynamo.eval_frame.OptimizedModule``) is private; this module is the only one that
names it, and without it (an older or trimmed torch) no module counts as compiled.
"""

from __future__ import annotations

from torch import nn


def compiled_module_names(root: nn.Module) -> tuple[str, ...]:
    """Names (as ``named_modules`` gives them) of the modules ``torch.compile`` wrapped, outermost only."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return ()
    names: list[str] = []
    for name, module in root.named_modules():
        if isinstance(module, OptimizedModule) and not any(name.startswith(f"{outer}.") for outer in names):
            names.append(name)
    return tuple(names)
