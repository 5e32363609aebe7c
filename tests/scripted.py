"""Scripted allocator readings for the CUDA code path on any machine: four boundaries per training step."""

from __future__ import annotations

from lightning_vram.testing import ScriptedBoundary

MIB = 1024**2


def scripted_steps(steps: list[tuple[int, int, int]], base: int = 100 * MIB) -> list[ScriptedBoundary]:
    """Four reads per step: batch start, before backward, before the optimizer step, batch end.

    Each step is (forward high, backward high, optimizer high); reserved grows with the step index.
    """
    boundaries = []
    for index, (forward, backward, optimizer) in enumerate(steps):
        reserved = 512 * MIB + index * MIB
        boundaries += [
            ScriptedBoundary(base, reserved, base),
            ScriptedBoundary(base + 10 * MIB, reserved, forward),
            ScriptedBoundary(base + 20 * MIB, reserved, backward),
            ScriptedBoundary(base, reserved + MIB // 2, optimizer),
        ]
    return boundaries
