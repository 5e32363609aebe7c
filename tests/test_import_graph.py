"""The package's imports: one direction, from the records up to the callback, and no circle.

The graph is read from the source with ``ast`` (every import, at module level or inside a function, ``TYPE_CHECKING``
ones included), so a lazy import cannot hide a circle or an upward arrow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_vram"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("lightning_vram.units", "lightning_vram.exceptions", "lightning_vram._version"),
    ("lightning_vram.records",),
    ("lightning_vram._guard", "lightning_vram.testing", "lightning_vram.codec"),
    ("lightning_vram.measure",),
    ("lightning_vram.prediction",),
    ("lightning_vram.advice",),
    ("lightning_vram.render",),
    ("lightning_vram.config", "lightning_vram.session"),
    (
        "lightning_vram.callback",
        "lightning_vram._lightning",
        "lightning_vram._handback",
        "lightning_vram.predict",
        "lightning_vram.plan",
        "lightning_vram.plan_inputs",
        "lightning_vram.plan_syntax",
        "lightning_vram.cli",
    ),
    ("lightning_vram.pytorch_lightning", "lightning_vram"),
)
"""The floors from the bottom up: a module imports from its own floor or the floors below, never above."""


def module_name(path: Path) -> str:
    """The dotted name of one of the package's files."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path) -> Iterator[str]:
    """The package's modules that one module imports, as dotted names (a submodule where one is named)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        yield from (target for target in targets if target in MODULES)


GRAPH = {name: sorted(set(imported(name, path)) - {name}) for name, path in MODULES.items()}


def floor_of(name: str) -> int:
    """The floor of a module: that of the longest prefix named in FLOORS (the package's face only by its own name)."""
    prefixes = [
        (len(prefix), index)
        for index, floor in enumerate(FLOORS)
        for prefix in floor
        if name == prefix or (name.startswith(prefix + ".") and prefix != "lightning_vram")
    ]
    assert prefixes, f"{name} is on no floor: add it to FLOORS"
    return max(prefixes)[1]


def circles() -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in GRAPH[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    return found


def test_the_graph_is_read() -> None:
    assert "lightning_vram.records" in MODULES
    assert "lightning_vram.records" in GRAPH["lightning_vram.measure.tracker"]


def test_no_circle() -> None:
    assert circles() == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_runs_upward(name: str) -> None:
    upward = [target for target in GRAPH[name] if floor_of(target) > floor_of(name)]
    assert upward == [], f"{name} (floor {floor_of(name)}) imports from above: {upward}"
