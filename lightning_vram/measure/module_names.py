"""A module tree's names as the user wrote them, past the stand-ins a replay puts in a module's place.

A replay that checkpoints a unit sets a wrapper where the unit's first module was, holding that module as a child
(``up3.block`` becomes a wrapper, the user's module ``up3.block.first``). A wrapper's class says which child it
stands for in :data:`STANDS_FOR`; the names here leave that level out, so every count, plan and picture of the
replay names the user's ``up3.block`` and its children as the user's model has them.
"""

from __future__ import annotations

from torch import nn

STANDS_FOR = "_lightning_vram_stands_for"
"""The class attribute of a stand-in module: the name of the child it stands for (the user's module)."""


def user_named_modules(root: nn.Module) -> dict[str, nn.Module]:
    """``root.named_modules()`` as a dict by name, the stand-ins left out and their children named past them.

    >>> class Wrapper(nn.Module):
    ...     _lightning_vram_stands_for = "first"
    ...     def __init__(self, first: nn.Module) -> None:
    ...         super().__init__()
    ...         self.first = first
    >>> model = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.ReLU()))
    >>> model[1] = Wrapper(model[1])
    >>> list(user_named_modules(model))
    ['', '0', '1', '1.0']
    """
    named = dict(root.named_modules())
    stand_ins = {name: str(getattr(type(module), STANDS_FOR, "")) for name, module in named.items()}
    stand_ins = {name: child for name, child in stand_ins.items() if child}
    if not stand_ins:
        return named
    users: dict[str, nn.Module] = {}
    for name, module in named.items():
        if name in stand_ins:
            continue
        parts = name.split(".")
        kept = [part for index, part in enumerate(parts) if stand_ins.get(".".join(parts[:index])) != part]
        users[".".join(kept)] = module
    return users
