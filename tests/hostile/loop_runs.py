"""Runs of the training-loop surface, with and without the monitor: whole Trainer scripts, read back exactly.

A script gets a fresh Trainer factory and the case's module and runs what a user runs (``fit`` and ``ckpt_path``,
``validate``, ``test``, ``predict``, a second ``fit``); what it returns, with the module's state, the global random
generators, every checkpoint file's training content and the user's warnings, is compared between the runs.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from harness import monitor_for
from models import trainer

from lightning_vram.exceptions import VramMonitorWarning

Factory = Callable[..., pl.Trainer]
"""Builds a Trainer under the run's root: ``callbacks`` (the user's, the monitor joins them), then Trainer options."""


def relative(value: Any, root: Path) -> Any:
    """``value`` with every string naming a path under ``root`` written relative to it (checkpoint paths)."""
    if isinstance(value, str):
        return value.replace(str(root), "<root>")
    if isinstance(value, dict):
        return {relative(key, root): relative(item, root) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(relative(item, root) for item in value)
    return value


def checkpoints(root: Path, monitored: set[str]) -> dict[str, Any]:
    """Every checkpoint file under ``root``, loaded, without the monitor's own entry in its callbacks' states.

    ``max_time``'s Timer keeps the wall time trained so far, which no two runs share: it is left out too.
    """
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*.ckpt")):
        content = torch.load(path, map_location="cpu", weights_only=False)
        content["callbacks"] = {
            key: state for key, state in content["callbacks"].items() if key not in monitored and key != "Timer"
        }
        found[str(path.relative_to(root))] = relative(content, root)
    return found


def run(
    script: Callable[[Factory], Any], root: Path, path: str | None, into: list[Any] | None = None, **options: Any
) -> tuple[dict[str, Any], Any]:
    """Seed everything and run ``script``; with the monitor on ``path`` (``None``: without). What the user reads.

    The monitors the run makes are appended to ``into`` as they are made (the script can find its own there).

    Warnings are compared without the objects' addresses their texts may hold (a scheduler's repr), which no two runs
    share, and without the monitor's own.
    """
    pl.seed_everything(0, verbose=False)
    np.random.seed(0)
    monitors: list[Any] = [] if into is None else into

    def factory(callbacks: list[pl.Callback] = [], monitor: bool = True, **trainer_options: Any) -> pl.Trainer:  # noqa: B006
        joined = list(callbacks)
        if path is not None and monitor:
            monitors.append(monitor_for(path, **options))
            joined.append(monitors[-1])
        return trainer(root, joined, **trainer_options)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = script(factory)
    keys = {monitor.state_key for monitor in monitors}
    return {
        "returned": relative(returned, root),
        "generators": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tobytes()),
        "checkpoints": checkpoints(root, keys),
        "warnings": [
            re.sub(" at 0x[0-9a-f]+", " at <address>", relative(f"{item.category.__name__}: {item.message}", root))
            for item in caught
            if not issubclass(item.category, VramMonitorWarning)
        ],
    }, monitors
