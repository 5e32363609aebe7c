"""A gloo rank's preflight, as the multi-process test scripts write it to ``preflight<rank>.json``."""

from __future__ import annotations

import warnings
from typing import Any

from training_records import monitor_warnings

from lightning_vram import VramSession


def preflight_record(session: VramSession, caught: list[warnings.WarningMessage]) -> dict[str, Any]:
    """The ranks' agreed rows, each rank's skip reason, this rank's own verdict (fits, needed and available bytes),
    its replayed step's notes and strategy line, and the monitor's warnings ``caught`` on this rank."""
    verdict, rows = session.preflight_verdict, session.preflight_ranks
    step = None if verdict is None else verdict.step
    return {
        "agreed": [[row.rank, row.fits, row.needed_bytes, row.available_bytes, row.peak_bytes] for row in rows],
        "skipped": [row.skipped for row in rows],
        "own": None if verdict is None else [verdict.fits, verdict.needed_bytes, verdict.available_bytes],
        "notes": [] if step is None else list(step.notes),
        "strategy": None if step is None or step.strategy is None else step.strategy.label,
        "warnings": monitor_warnings(caught),
    }
