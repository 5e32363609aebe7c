"""The syntax of ``lightning-vram plan``'s arguments, checked without torch: a bad one is refused in a second.

The command checks these before it imports torch or builds the user's module (which takes many seconds); what needs
either (a GPU's name, a precision, a strategy) is checked by :func:`lightning_vram.plan.plan` after.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

MAX_BATCH_ELEMENTS = 2**28
"""The most elements one described tensor may have (1 GiB of float32): the zeros are real, on the CPU."""
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "double": "float64",
    "int64": "int64",
    "long": "int64",
    "int32": "int32",
    "int": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}
"""The dtypes a batch description names, torch's names and their short forms, each with torch's attribute name."""
_ITEM = re.compile(r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<dtype>[a-z0-9]+)\[(?P<dims>[^\[\]]*)\]$")
BATCH_SYNTAX = (
    "dtype[sizes] items separated by spaces, each optionally name=, e.g. 'float32[8,3,32,32] int64[8]'"
    " (one item and a comma: a tuple of one)"
)
"""The batch description's syntax, as an error message names it."""
MAX_GPU_BYTES = 2**50
"""The most memory a GPU given in bytes may have (1 PiB)."""


class PlanInputError(ValueError):
    """An argument of a plan that is not one: its message names the argument, what it must be and what it got."""


def one_tuple(text: str) -> tuple[str, bool]:
    """A batch description without its trailing comma, and whether it had one (a tuple of one tensor, as in Python).

    >>> one_tuple("int64[8,128],"), one_tuple("int64[8,128]")
    (('int64[8,128]', True), ('int64[8,128]', False))
    """
    stripped = text.rstrip()
    return (stripped[:-1], True) if stripped.endswith(",") else (text, False)


def batch_items(text: str, argument: str = "batch") -> list[tuple[str | None, str, tuple[int, ...]]]:
    """Each tensor a batch description names: its name (``None``: unnamed), torch's dtype name, its shape.

    >>> batch_items("x=long[8,128] y=half[2]")
    [('x', 'int64', (8, 128)), ('y', 'float16', (2,))]
    >>> batch_items("int64[8,128", "--batch")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_vram.plan_syntax.PlanInputError: --batch must be dtype[sizes] items ...; got ... no closing ']')
    >>> batch_items("float32[-1,3]", "--batch")
    Traceback (most recent call last):
    ...
    lightning_vram.plan_syntax.PlanInputError: --batch must give sizes as integers >= 1; got '-1' in 'float32[-1,3]'
    """
    shown = text if len(text) <= 200 else text[:199] + "…"
    tokens = re.findall(r"[^\s\[]+\[[^\]]*\]|\S+", one_tuple(text)[0])
    if not tokens:
        raise PlanInputError(f"{argument} must be {BATCH_SYNTAX}; got an empty description")
    items = []
    for token in tokens:
        match = _ITEM.match(token)
        if match is None:
            why = "no closing ']'" if "[" in token and "]" not in token else "not name=dtype[sizes]"
            raise PlanInputError(f"{argument} must be {BATCH_SYNTAX}; got {shown!r} (item {token!r}, {why})")
        dtype = DTYPE_NAMES.get(match["dtype"])
        if dtype is None:
            raise PlanInputError(
                f"{argument} must name a dtype of {', '.join(DTYPE_NAMES)}; got {match['dtype']!r} in {shown!r}"
            )
        sizes = [part.strip() for part in match["dims"].split(",")] if match["dims"].strip() else []
        bad = next((size for size in sizes if not (size.isascii() and size.isdigit()) or int(size) < 1), None)
        if bad is not None:
            raise PlanInputError(f"{argument} must give sizes as integers >= 1; got {bad!r} in {token!r}")
        shape = tuple(int(size) for size in sizes)
        if math.prod(shape) > MAX_BATCH_ELEMENTS:
            raise PlanInputError(
                f"{argument} must describe tensors of at most {MAX_BATCH_ELEMENTS:,} elements each; got {token!r}"
            )
        items.append((match["name"], dtype, shape))
    named = [name for name, _, _ in items if name is not None]
    if named and len(named) != len(items):
        raise PlanInputError(f"{argument} must name every tensor (name=dtype[sizes]) or none, got {text!r}")
    if len(set(named)) != len(named):
        raise PlanInputError(f"{argument} must name each tensor once, got {text!r}")
    return items


def gpu_bytes(gpu: str | int, argument: str = "gpus") -> int | None:
    """A GPU given as its memory in bytes (``None``: given by name, which needs the GPU tables to check).

    >>> gpu_bytes("80000000000"), gpu_bytes("H100")
    (80000000000, None)
    """
    if isinstance(gpu, str) and gpu.strip().isdigit():
        gpu = int(gpu.strip())
    if not isinstance(gpu, int) or isinstance(gpu, bool):
        return None
    if not 2**20 <= gpu <= MAX_GPU_BYTES:
        raise PlanInputError(f"{argument} must give a GPU's memory as bytes from 1 MiB to 1 PiB, got {gpu!r}")
    return gpu


def check_count(value: int | None, argument: str, most: int, must: str = "be an int") -> None:
    """A count the command took (``--gpus``, ``--nodes``, ``--global-batch``): an int from 1 to ``most``, or unset.

    >>> check_count(0, "--nodes", 1024)
    Traceback (most recent call last):
    ...
    lightning_vram.plan_syntax.PlanInputError: --nodes must be an int from 1 to 1024, got 0
    """
    if value is not None and not 1 <= value <= most:
        raise PlanInputError(f"{argument} must {must} from 1 to {most}, got {value!r}")


def check_split(global_batch: int | None, world_sizes: Sequence[int], argument: str = "global_batch") -> None:
    """A global batch that some GPU count planned for splits evenly: each rank takes an equal share, in samples.

    A count it does not split over is left out of the plan (and says so); none at all is a bad argument.

    >>> check_split(10, [4])
    Traceback (most recent call last):
    ...
    lightning_vram.plan_syntax.PlanInputError: global_batch must be a multiple of a GPU count planned for (4), got 10
    """
    if global_batch is not None and world_sizes and all(global_batch % size for size in world_sizes):
        counts = ", ".join(str(size) for size in world_sizes)
        raise PlanInputError(f"{argument} must be a multiple of a GPU count planned for ({counts}), got {global_batch}")
