"""The monitor's own cost per training step, over a run without it and over a run with an empty callback.

A real Trainer trains a tiny model on the CPU. Four kinds of run, interleaved round by round so that a load on the
machine falls on each alike:

- ``bare``: no callback;
- ``empty``: a callback that overrides nothing (what Lightning's dispatch of the hooks costs any callback);
- ``cuda``: VramMonitor reading a :class:`~lightning_vram.testing.ScriptedProbe`, so the CUDA code path runs
  (on ordinary steps a peak reset at the start and one allocator read at the end, folded by the tracker; the steps
  read phase by phase are the run's first ``PHASE_READ_STEPS``, the sampled one and each log interval's last);
- ``cpu``: VramMonitor on the CPU path (the CPU probe: no allocator, tensors counted on sampled steps only).

With ``--accelerator gpu`` the runs train on the CUDA device instead, and the monitor's kind is ``gpu``: VramMonitor
with its own probe, so each hook's time includes the real allocator calls (``reset_peak_memory_stats`` as a step
starts, one ``torch._C._cuda_memoryStats`` as it ends on ordinary steps). Kernels run asynchronously, so the time inside
the hooks is the host time the monitor takes from each step: issue 24's target is about 50 us.

For each, the wall time per step over the ordinary steps (from step ``SKIP`` on: step 0's preflight and the one
sampled step, counted and replayed once per run, are left out; ``benchmarks/replay_cost.py`` prices those). The
monitor's cost is its run's step time less the empty callback's; beside it, the time spent inside the monitor's own
hooks, timed one by one (no dispatch). Logging runs at Lightning's default interval of 50 steps, so its work is
amortised as in a real run. Median over rounds, with the range: microseconds per step.

    python benchmarks/hot_path.py [--steps 2000] [--rounds 5] [--accelerator gpu] [--by-hook TOP]

``--by-hook TOP`` adds each hook's own time (mean, largest, share of a step) and, for ``TOP`` > 0, the ``TOP``
functions of a cProfile of the hooks on ordinary steps: where the time inside them goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
)
"""The monitor's hooks that run during training steps and epochs."""
SAMPLED_STEP = 2
"""The one step counted tensor by tensor (and replayed)."""
SKIP = 10
"""Steps left out at the start of each run: warm-up, the preflight and the sampled step."""
CPU_KINDS = ("bare", "empty", "cuda", "cpu")
GPU_KINDS = ("bare", "empty", "gpu")
MONITOR_PATHS = {"cuda": "CUDA path, scripted probe", "cpu": "CPU path", "gpu": "CUDA path, this GPU"}
"""The monitored kinds of run and what each measures."""


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Stopwatch(pl.Callback):
    """Reads the clock when step ``SKIP`` starts and when each later step ends (every kind of run carries one).

    The last step's end, not the end of training: the monitor builds and writes its report then.
    """

    def __init__(self) -> None:
        self.started = self.ended = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == SKIP:
            self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.ended = time.perf_counter()


class HookTimes:
    """Where the time inside the monitor's hooks goes, over the ordinary steps (from step ``SKIP`` on).

    ``seconds``: each hook's calls, in seconds; ``profile``: a ``cProfile`` of those calls where one is asked for.
    """

    def __init__(self, profile: bool) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.profile = cProfile.Profile() if profile else None

    def print(self, steps: int) -> None:
        """Each hook's mean, largest and share of a step over ``steps`` steps, in microseconds."""
        for name, calls in self.seconds.items():
            if not calls:  # on_train_epoch_start: before the first step
                continue
            print(
                f"    {name:<27}{len(calls):6d} calls, mean {1e6 * statistics.fmean(calls):8.1f} us,"
                f" largest {1e6 * max(calls):9.1f} us, {1e6 * sum(calls) / steps:7.1f} us a step"
            )


def timed(
    method: Callable[..., Any], per_step: list[float], starts_step: bool, times: HookTimes | None = None
) -> Callable[..., Any]:
    """``method``, adding the seconds it takes to the last entry of ``per_step`` (a new entry if ``starts_step``);
    with ``times``, each call from step ``SKIP`` on is also kept there by hook (and profiled, where it profiles)."""
    calls = times.seconds.setdefault(method.__name__, []) if times is not None else None
    profile = times.profile if times is not None else None

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if starts_step:
            per_step.append(0.0)
        ordinary = calls is not None and len(per_step) > SKIP
        if ordinary and profile is not None:
            profile.enable()
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            if ordinary and profile is not None:
                profile.disable()
            if per_step:
                per_step[-1] += seconds
            if ordinary and calls is not None:
                calls.append(seconds)

    return wrapper


def monitor(kind: str, per_step: list[float] | None, times: HookTimes | None = None) -> pl.Callback:
    """The callback of a ``kind`` of run; a monitor's hooks add their own time to ``per_step`` when one is given
    (and to ``times``, by hook)."""
    if kind == "empty":
        return pl.Callback()
    boundaries = [
        ScriptedBoundary(allocated_bytes=1000 + 10 * i, reserved_bytes=4096, highest_bytes=1500 + 10 * i)
        for i in range(4)
    ]
    built = VramMonitor(
        attribution_start_step=SAMPLED_STEP,
        attribution_every_n_steps=None,
        console_summary=False,
        probe=ScriptedProbe(boundaries) if kind == "cuda" else None,  # "gpu" and "cpu": the device's own probe
    )
    if per_step is not None:
        for name in HOOKS:
            method = getattr(built, name)
            setattr(built, name, timed(method, per_step, starts_step=name == "on_train_batch_start", times=times))
    return built


def one_round(
    kind: str, steps: int, time_hooks: bool, accelerator: str = "cpu", times: HookTimes | None = None
) -> tuple[float, float | None]:
    """Seconds per ordinary step of one fit of ``steps`` steps, and the seconds inside the monitor's hooks.

    The hooks are timed only where ``time_hooks`` (the wrappers cost time of their own), and kept by hook in
    ``times`` where one is given.
    """
    per_step: list[float] = []
    callbacks = [] if kind == "bare" else [monitor(kind, per_step if time_hooks else None, times)]
    stopwatch = Stopwatch()
    data = TensorDataset(torch.randn(steps, 4), torch.randint(0, 2, (steps,)))
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator=accelerator,
            devices=1,
            max_steps=steps,
            logger=CSVLogger(root),
            callbacks=[*callbacks, stopwatch],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=root,
        )
        trainer.fit(Tiny(), DataLoader(data, batch_size=1))
    step_seconds = (stopwatch.ended - stopwatch.started) / (steps - SKIP)  # from step SKIP to the last, both in
    inside = statistics.fmean(per_step[SKIP:]) if per_step else None
    return step_seconds, inside


def shown(seconds: list[float]) -> str:
    """Median and range of ``seconds``, in microseconds."""
    micro = [1e6 * value for value in seconds]
    return f"{statistics.median(micro):7.1f} us [{min(micro):.1f} - {max(micro):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="where the runs train")
    parser.add_argument("--warmup-steps", type=int, default=200, help="steps of each kind's unrecorded first run")
    parser.add_argument(
        "--by-hook",
        type=int,
        metavar="TOP",
        default=None,
        help="after the table, one more fit of each monitored kind: each hook's time, and the TOP functions of a"
        " cProfile of the hooks on ordinary steps (0: no profile)",
    )
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    accelerator = arguments.accelerator
    kinds = GPU_KINDS if accelerator == "gpu" else CPU_KINDS
    monitored = [kind for kind in kinds if kind in MONITOR_PATHS]
    for kind in kinds:  # warm-up: imports, first-call costs
        one_round(kind, arguments.warmup_steps, time_hooks=kind in monitored, accelerator=accelerator)
    step: dict[str, list[float]] = {kind: [] for kind in kinds}
    inside: dict[str, list[float]] = {kind: [] for kind in monitored}
    over: dict[str, list[float]] = {kind: [] for kind in monitored}
    for _ in range(arguments.rounds):
        for kind in kinds:
            step[kind].append(one_round(kind, arguments.steps, time_hooks=False, accelerator=accelerator)[0])
        for kind in monitored:
            over[kind].append(step[kind][-1] - step["empty"][-1])
            hooks = one_round(kind, arguments.steps, time_hooks=True, accelerator=accelerator)[1]
            inside[kind].append(hooks if hooks is not None else float("nan"))
    device = torch.cuda.get_device_name() if accelerator == "gpu" else "cpu"
    print(f"device: {device}; torch {torch.__version__}")
    print(f"per training step, {arguments.steps} steps x {arguments.rounds} rounds: median [range]")
    print(f"  bare run (no callback)          {shown(step['bare'])}")
    print(f"  empty callback                  {shown(step['empty'])}")
    for kind in monitored:
        print(f"  monitor, {MONITOR_PATHS[kind]:<23}{shown(step[kind])}")
        print(f"    over the empty callback       {shown(over[kind])}")
        print(f"    inside its hooks              {shown(inside[kind])}")
    if arguments.by_hook is not None:
        ordinary = arguments.steps - SKIP
        for kind in monitored:
            times = HookTimes(profile=False)
            one_round(kind, arguments.steps, time_hooks=True, accelerator=accelerator, times=times)
            print(f"  monitor, {MONITOR_PATHS[kind]}, by hook over {ordinary} ordinary steps:")
            times.print(ordinary)
            if arguments.by_hook > 0:  # a fit of its own: the profiler's cost stays out of the times above
                profiled = HookTimes(profile=True)
                one_round(kind, arguments.steps, time_hooks=True, accelerator=accelerator, times=profiled)
                assert profiled.profile is not None
                text = io.StringIO()
                pstats.Stats(profiled.profile, stream=text).sort_stats("tottime").print_stats(arguments.by_hook)
                print(text.getvalue())


if __name__ == "__main__":
    main()
