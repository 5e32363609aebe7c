"""The code a checkpointing plan asks the user to write, for the advice's title and detail.

Three idioms, each the one the replay applied to check the plan:

- a transformers model's own switch (``model.activation_checkpointing_enable(...)``): every layer of every stack;
- a ``Checkpointed`` wrapper put in place of each unit of one module (the usual case): the unit runs under
  ``checkpoint`` with every argument its caller gives it (positional and keyword: attention masks, position
  embeddings) and returns what it returns (a tensor, a tuple, a dict), so the caller's code does not change;
- for a unit of several consecutive modules (an inplace op joins the one before it), ``x = ...`` lines in the forward
  that calls them, and for an ``nn.Sequential`` a loop over its segments as ``checkpoint_sequential`` splits them:
  both pass one tensor along.

Every one of them checkpoints through ``checkpoint_keeping_buffers`` (printed with it): backward's recomputation
runs on copies of the units' buffers, so that a train-mode BatchNorm updates its running statistics once a step, as
without checkpointing, and the checkpointed model learns exactly what the plain one does.
"""

from __future__ import annotations

from itertools import groupby

from lightning_vram.records import CheckpointPlan

CHECKPOINT_LINES = 6
"""Units spelled out one line each in the advice's code; the rest are named."""

KEEPING_BUFFERS = '''import contextlib

from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _buffers_copied(modules):
    """Runs the body with every buffer of `modules` replaced by a copy, then puts the originals back."""
    originals = {}
    for owner in modules:
        for module in owner.modules():
            for name, buffer in module.named_buffers(recurse=False):
                originals[id(module), name] = (module, name, buffer)
    for module, name, buffer in originals.values():
        setattr(module, name, buffer.clone())
    try:
        yield
    finally:
        for module, name, buffer in originals.values():
            setattr(module, name, buffer)


def checkpoint_keeping_buffers(modules, function, *args, **kwargs):
    """`checkpoint(function, *args, **kwargs)` whose recomputation in backward runs on copies of the buffers of
    `modules`: BatchNorm's running statistics change once a step, as without checkpointing (pytorch#96136)."""
    modules = list(modules)
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _buffers_copied(modules)),
        **kwargs,
    )
'''
"""The checkpoint call every printed plan uses (the replay runs the same,
:func:`~lightning_vram.prediction.replay.buffer_copies.checkpoint_keeping_buffers`)."""

CHECKPOINTED_CLASS = '''from torch import nn


class Checkpointed(nn.Module):
    """Runs `block` under activation checkpointing with every argument it is given; returns what it returns."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint_keeping_buffers([self.block], self.block, *args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # a caller reading the block's settings
            if name == "block":
                raise
            return getattr(self.block, name)
'''
"""The wrapper the advice prints (and the replay's ``_CheckpointedCall`` does the same for a one-module unit)."""


def _code_path(name: str, forward_of: str) -> str:
    """Module ``name`` as code in the forward of ``forward_of``.

    >>> _code_path("transformer.h.3", "transformer"), _code_path("network.conv1", ""), _code_path("", "")
    ('self.h[3]', 'self.network.conv1', 'self')
    """
    relative = name[len(forward_of) + 1 :] if forward_of else name
    if not relative:
        return "self"
    return "self" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in relative.split("."))


def layer_ranges(names: tuple[str, ...]) -> str:
    """Layers by name, consecutive indices of one parent as a range.

    >>> layer_ranges(("m.encoder.block.0", "m.encoder.block.1", "m.decoder.block.0", "m.decoder.block.1", "m.head"))
    'm.encoder.block.0-1, m.decoder.block.0-1 and m.head'
    """
    parts: list[str] = []
    for parent, group in groupby(names, key=lambda name: name.rpartition(".")[0]):
        indices = [name.rpartition(".")[2] for name in group]
        if all(index.isdigit() for index in indices) and [int(index) for index in indices] == list(
            range(int(indices[0]), int(indices[0]) + len(indices))
        ):
            span = indices[0] if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"
            parts.append(f"{parent}.{span}" if parent else span)
        else:
            parts += [f"{parent}.{index}" if parent else index for index in indices]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _unit_line(unit: tuple[str, ...], forward_of: str) -> str:
    """The line checkpointing one unit: its modules, and the module or a lambda running them in order."""
    paths = [_code_path(name, forward_of) for name in unit]
    call = paths[0]
    if len(unit) > 1:
        call = "t"
        for path in paths:
            call = f"{path}({call})"
        call = f"lambda t: {call}"
    return f"x = checkpoint_keeping_buffers([{', '.join(paths)}], {call}, x)"


def _segments_lines(plan: CheckpointPlan, path: str) -> list[str]:
    r"""A loop over the checkpointed segments of the ``nn.Sequential`` at ``path``, then its last segment.

    >>> plan = CheckpointPlan("features", (("features.0", "features.1"), ("features.2", "features.3")), 3, 0, "")
    >>> print("\n".join(_segments_lines(plan, "self.features")))
    for start, end in ((0, 2), (2, 4)):
        segment = self.features[start:end]
        x = checkpoint_keeping_buffers(segment, segment, x)
    x = self.features[4:](x)
    """
    bounds: list[tuple[int, int]] = []
    for unit in plan.units:
        start = bounds[-1][1] if bounds else 0
        bounds.append((start, start + len(unit)))
    spans = ", ".join(f"({start}, {end})" for start, end in bounds)
    return [
        f"for start, end in ({spans}{',' if len(bounds) == 1 else ''}):",
        f"    segment = {path}[start:end]",
        "    x = checkpoint_keeping_buffers(segment, segment, x)",
        f"x = {path}[{bounds[-1][1]}:](x)",
    ]


def _switch_snippet(plan: CheckpointPlan) -> tuple[str, str]:
    """The library's own call, on the model that has it, and the layers it covers."""
    layers = tuple(unit[0] for unit in plan.units)
    model = _code_path(plan.container, "")
    argument = (plan.switch or "").removesuffix("_enable") + "_kwargs"
    what = f"every layer of `{plan.container or 'the model'}` ({layer_ranges(layers)}) with its own switch"
    code = (
        f"# in the LightningModule's __init__, once {model} is built (it checkpoints while training):\n"
        f"{model}.config.use_cache = False  # a key/value cache is of no use in training and clashes with it\n"
        f'{model}.{plan.switch}({argument}={{"use_reentrant": False}})'
    )
    return what, code


def _wrap_lines(names: list[str]) -> list[str]:
    """Lines putting ``Checkpointed`` in place of each module ``names`` (children of one parent), once it is built.

    >>> _wrap_lines(["net.h.1", "net.h.2"])
    ['for index in range(1, 3):', '    self.net.h[index] = Checkpointed(self.net.h[index])']
    """
    container = _code_path(names[0].rpartition(".")[0], "")
    indices = [name.rpartition(".")[2] for name in names]
    if len(names) == 1 or not all(map(str.isdigit, indices)):
        return [f"{_code_path(name, '')} = Checkpointed({_code_path(name, '')})" for name in names]
    first, last = int(indices[0]), int(indices[-1])
    over = (
        f"range({first}, {last + 1})"
        if list(map(int, indices)) == list(range(first, last + 1))
        else f"({', '.join(indices)})"
    )
    return [f"for index in {over}:", f"    {container}[index] = Checkpointed({container}[index])"]


def _wrapper_snippet(plan: CheckpointPlan) -> str:
    """The ``Checkpointed`` wrapper put in place of each one-module unit (every stack's), once the model is built."""
    names = [unit[0] for unit in plan.units]
    lines = [
        line
        for _, group in groupby(names, key=lambda name: name.rpartition(".")[0])
        for line in _wrap_lines(list(group))
    ]
    return (
        f"{KEEPING_BUFFERS}\n\n{CHECKPOINTED_CLASS}\n\n"
        "# in the LightningModule's __init__, once the model is built (their state_dict keys gain `.block`):\n"
        + "\n".join(lines)
    )


def checkpoint_snippet(plan: CheckpointPlan) -> tuple[str, str]:
    """What the plan checkpoints, in words (for the title), and the code to write (for the detail)."""
    if plan.switch is not None:
        return _switch_snippet(plan)
    forward_of = plan.forward_of or ""
    where = f"the forward of `{forward_of}`" if forward_of else "the LightningModule's forward (or training_step)"
    if plan.sequential_segments is not None:
        path = _code_path(plan.container, forward_of)
        what = f"`{plan.container}` (an nn.Sequential) in {plan.sequential_segments} segments"
        code = (
            f"{KEEPING_BUFFERS}\n\n"
            f"# in {where}, instead of {path}(x), its segments as torch's checkpoint_sequential splits them; the last"
            " segment runs without checkpointing:\n" + "\n".join(_segments_lines(plan, path))
        )
        return what, code
    first, last = plan.units[0][0], plan.units[-1][-1]
    what = (
        f"`{first}`"
        if len(plan.units) == 1
        else f"{len(plan.units)} units of {f'`{plan.container}`' if plan.container else 'the model'}, `{first}` to"
        f" `{last}`"
    )
    if all(len(unit) == 1 for unit in plan.units):
        return what, _wrapper_snippet(plan)
    lines = [_unit_line(unit, forward_of) for unit in plan.units]
    if len(lines) > CHECKPOINT_LINES:
        rest = ", ".join(f"`{unit[0]}`" for unit in plan.units[CHECKPOINT_LINES:])
        lines = [*lines[:CHECKPOINT_LINES], f"# ... and the same for {rest}"]
    merged = [f"`{name}`" for unit in plan.units for name in unit[1:]]
    note = (
        f"# ({', '.join(merged)} run(s) inplace: each stays in the unit before it, which recomputes it)\n"
        if merged
        else ""
    )
    code = (
        f"{KEEPING_BUFFERS}\n\n"
        f"# in {where}, replace the call of each unit by (everything else runs as before):\n{note}" + "\n".join(lines)
    )
    return what, code
