"""The monitor's settings, checked when the callback is built."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STEPS = 10**12
"""Upper bound of every option counted in training steps (a trillion steps: far beyond any run)."""
MAX_RECENT_STEPS = 10**6
"""Upper bound of ``recent_steps``: the recent step peaks kept in memory for charts."""
MAX_TOP_MODULES = 10**4
"""Upper bound of ``top_modules``: rows of the module table in the report."""
MAX_HISTORY_ENTRIES = 10**7
"""Upper bound of ``history_max_entries``: allocation events (each with its Python stack) kept in memory."""
MIN_INTERVAL_SECONDS = 0.01
"""Lower bound of ``utilization_interval_seconds``: NVML's own sample window is 1/6 s to 1 s."""
MAX_INTERVAL_SECONDS = 60.0
"""Upper bound of ``utilization_interval_seconds``: a longer wait leaves most log intervals without a sample."""
MAX_REPLAY_BUDGET_SECONDS = 3600.0
"""Upper bound of ``replay_budget_seconds``: an hour of host time, far above what a replay of a large model takes."""


def _require_int(name: str, value: object, minimum: int, maximum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def _require_seconds(name: str, value: object, minimum: float, maximum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number of seconds, got {value!r} ({type(value).__name__})")
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if not minimum <= value <= maximum:  # also infinity; NaN failed the test above
        raise ValueError(f"{name} must be a positive number of seconds from {minimum} to {maximum}, got {value!r}")


def _require_budget(name: str, value: object, maximum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds from 0 to {maximum}, got {value!r} ({type(value).__name__})"
        )
    if not 0 <= value <= maximum:  # NaN fails too
        raise ValueError(f"{name} must be a number of seconds from 0 (off) to {maximum}, got {value!r}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class MonitorConfig:
    """Settings of :class:`~lightning_vram.VramMonitor`; see its docstring for each one."""

    log_every_n_steps: int | None = None
    attribution_start_step: int = 2
    attribution_every_n_steps: int | None = 100
    reset_peak_stats: bool = True
    utilization_interval_seconds: float = 0.5
    top_modules: int = 10
    recent_steps: int = 512
    console_summary: bool = True
    record_history: bool = False
    history_max_entries: int = 100_000
    replay_budget_seconds: float = 30.0
    preflight: bool = True

    def __post_init__(self) -> None:
        _require_int("log_every_n_steps", self.log_every_n_steps, 1, MAX_STEPS, allow_none=True)
        _require_int("attribution_start_step", self.attribution_start_step, 0, MAX_STEPS)
        _require_int("attribution_every_n_steps", self.attribution_every_n_steps, 1, MAX_STEPS, allow_none=True)
        _require_bool("reset_peak_stats", self.reset_peak_stats)
        interval = self.utilization_interval_seconds
        _require_seconds("utilization_interval_seconds", interval, MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS)
        _require_int("top_modules", self.top_modules, 1, MAX_TOP_MODULES)
        _require_int("recent_steps", self.recent_steps, 1, MAX_RECENT_STEPS)
        _require_bool("console_summary", self.console_summary)
        _require_bool("record_history", self.record_history)
        _require_int("history_max_entries", self.history_max_entries, 1, MAX_HISTORY_ENTRIES)
        _require_budget("replay_budget_seconds", self.replay_budget_seconds, MAX_REPLAY_BUDGET_SECONDS)
        _require_bool("preflight", self.preflight)

    def is_sampled(self, step: int) -> bool:
        """Whether ``step`` (0-based training batch of the run) gets tensor-by-tensor attribution.

        >>> MonitorConfig(attribution_start_step=2, attribution_every_n_steps=10).is_sampled(12)
        True
        >>> MonitorConfig(attribution_start_step=2, attribution_every_n_steps=None).is_sampled(12)
        False
        """
        offset = step - self.attribution_start_step
        if offset < 0:
            return False
        if self.attribution_every_n_steps is None:
            return offset == 0
        return offset % self.attribution_every_n_steps == 0
