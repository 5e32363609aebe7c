"""The code a checkpointing plan asks the user to write, for the advice's title and detail."""

from __future__ import annotations

from lightning_vram.records import CheckpointPlan

CHECKPOINT_LINES = 6
"""Units spelled out one line each in the advice's code; the rest are named."""


def _code_path(name: str, forward_of: str) -> str:
    """Module ``name`` as code in the forward of ``forward_of``.

    >>> _code_path("transformer.h.3", "transformer"), _code_path("network.conv1", "")
    ('self.h[3]', 'self.network.conv1')
    """
    relative = name[len(forward_of) + 1 :] if forward_of else name
    return "self" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in relative.split("."))


def _unit_call(unit: tuple[str, ...], forward_of: str) -> str:
    """The callable ``checkpoint`` gets for one unit: the module, or a lambda running its modules in order."""
    if len(unit) == 1:
        return _code_path(unit[0], forward_of)
    call = "t"
    for name in unit:
        call = f"{_code_path(name, forward_of)}({call})"
    return f"lambda t: {call}"


def checkpoint_snippet(plan: CheckpointPlan) -> tuple[str, str]:
    """What the plan checkpoints, in words (for the title), and the code to write (for the detail)."""
    forward_of = plan.forward_of or ""
    where = f"the forward of `{forward_of}`" if forward_of else "the LightningModule's forward (or training_step)"
    if plan.sequential_segments is not None:
        path = _code_path(plan.container, forward_of)
        what = f"`{plan.container}` (an nn.Sequential) in {plan.sequential_segments} segments"
        code = (
            "from torch.utils.checkpoint import checkpoint_sequential\n"
            f"# in {where}, instead of {path}(x); the last segment runs without checkpointing:\n"
            f"x = checkpoint_sequential({path}, segments={plan.sequential_segments}, input=x, use_reentrant=False)"
        )
        return what, code
    first, last = plan.units[0][0], plan.units[-1][-1]
    what = (
        f"`{first}`"
        if len(plan.units) == 1
        else f"{len(plan.units)} units of {f'`{plan.container}`' if plan.container else 'the model'}, `{first}` to"
        f" `{last}`"
    )
    indices = [unit[0].rsplit(".", 1)[-1] for unit in plan.units]
    if plan.container != forward_of and all(len(unit) == 1 for unit in plan.units) and all(map(str.isdigit, indices)):
        loop = _code_path(plan.container, forward_of)
        code = (
            "from torch.utils.checkpoint import checkpoint\n"
            f"# in {where}, in its loop over {loop}:\n"
            f"for index, block in enumerate({loop}):\n"
            f"    x = checkpoint(block, x, use_reentrant=False) if {indices[0]} <= index <= {indices[-1]} else block(x)"
        )
        return what, code
    lines = [f"x = checkpoint({_unit_call(unit, forward_of)}, x, use_reentrant=False)" for unit in plan.units]
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
        "from torch.utils.checkpoint import checkpoint\n"
        f"# in {where}, replace the call of each unit by (everything else runs as before):\n{note}" + "\n".join(lines)
    )
    return what, code
