"""Advice whose code names the thing that trains the model: a Trainer, Fabric, or a plain loop's own lines.

A plain or Fabric loop measured by ``VramSession`` was given ``Trainer(precision="bf16-mixed")`` by the
mixed-precision advice and ``Trainer(strategy="fsdp", devices=4)`` by the optimizer-state advice: there is no Trainer
in such a loop. Each now prints the loop's own change (and the stale-gradients advice, tests/
test_stale_gradients_in_a_loop.py).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from advice_summaries import GIB, GPU, HEALTHY_BREAKDOWN, healthy_setup, healthy_summary, peak

from lightning_vram.advice.checkpoint_code import CodeContext
from lightning_vram.advice.rules.mixed_precision import mixed_precision
from lightning_vram.advice.rules.optimizer_state import optimizer_state
from lightning_vram.records import Advice, Phase, TrainingLoop


def _code(advice: Advice | None) -> str:
    assert advice is not None
    block = re.search(r"```python\n(.*?)\n```", advice.detail, re.S)
    assert block is not None, advice.detail
    return block.group(1)


@pytest.mark.parametrize(
    ("loop", "expected"),
    [
        (TrainingLoop.LIGHTNING, 'Trainer(precision="bf16-mixed")'),
        (TrainingLoop.FABRIC, 'Fabric(precision="bf16-mixed")  # and session.start(..., precision="bf16-mixed")'),
        (TrainingLoop.PLAIN, 'with torch.autocast("cuda", dtype=torch.bfloat16):'),
    ],
)
def test_mixed_precision_code_is_the_loops(loop: TrainingLoop, expected: str) -> None:
    code = _code(mixed_precision(healthy_summary(), healthy_setup(precision="32-true", loop=loop)))
    assert expected in code, code
    if loop is not TrainingLoop.LIGHTNING:
        # Before: 'Trainer(precision="bf16-mixed")' whatever trained the model.
        assert "Trainer(" not in code, code


def test_a_plain_loop_in_float16_scales_its_loss() -> None:
    volta = healthy_summary(device=replace(GPU, compute_capability=(7, 0)))
    code = _code(mixed_precision(volta, healthy_setup(precision="32-true", loop=TrainingLoop.PLAIN)))
    assert 'with torch.autocast("cuda", dtype=torch.float16):' in code
    assert 'scaler = torch.amp.GradScaler("cuda")' in code and "scaler.scale(loss).backward()" in code
    assert "scaler.step(optimizer)" in code and "scaler.update()" in code
    assert 'session.start(..., precision="16-mixed")' in code


@pytest.mark.parametrize(
    ("loop", "expected"),
    [
        (TrainingLoop.LIGHTNING, 'Trainer(strategy="fsdp", devices=4)'),
        (TrainingLoop.FABRIC, 'Fabric(strategy="fsdp", devices=4)'),
        (TrainingLoop.PLAIN, "fully_shard(model)  # before creating the optimizer, on each of 4 ranks"),
    ],
)
def test_optimizer_state_sharding_code_is_the_loops(loop: TrainingLoop, expected: str) -> None:
    state_heavy = replace(HEALTHY_BREAKDOWN, optimizer_state=4 * GIB, activations=GIB, other=GIB)
    summary = healthy_summary(peak=peak(Phase.BACKWARD, 8 * GIB, state_heavy))
    code = _code(optimizer_state(summary, healthy_setup(optimizers=("SGD",), world_size=4, loop=loop)))
    assert expected in code, code
    if loop is not TrainingLoop.LIGHTNING:
        assert "Trainer(" not in code, code  # before: Trainer(strategy="fsdp", devices=4)


def test_fabric_checkpoint_lines_name_the_module_as_built_not_what_session_start_took() -> None:
    """A new user's Fabric loop passed `fabric.setup`'s wrapper to `session.start`, as the README allows; the printed
    checkpointing lines said `model` was "the module given to `session.start`" and that they go "before
    `fabric.setup(model, optimizer)`", before that wrapper exists. They now name the module as built."""
    fabric = CodeContext(TrainingLoop.FABRIC).built("the model")
    assert "session.start" not in fabric
    assert fabric == (
        "after building the model (`model`: your module as built, the one you pass to `fabric.setup`),"
        " before `fabric.setup(model, optimizer)`"
    )
    assert CodeContext(TrainingLoop.PLAIN).built("the model") == (
        "after building the model (`model`: the module given to `session.start`), before creating its optimizer and"
        " starting the loop"
    )
