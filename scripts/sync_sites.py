"""List every place VramMonitor's step hooks synchronise a CUDA device, with its Python stack.

Trains the configuration of ``tests/test_gpu.py::test_monitor_hooks_never_synchronise`` (the tests' small CNN
classifier with a BatchNorm, batches of 64, 6 steps, ``VramMonitor(attribution_start_step=1,
attribution_every_n_steps=2, log_every_n_steps=1)``, a CSVLogger) with ``torch.cuda.set_sync_debug_mode("warn")`` on
only while the monitor's four step hooks run (a callback on each side of it, as the test's ``SyncGuard``). Each
synchronisation torch warns about is caught (at ``warnings._showwarnmsg``, past the replay's own ``showwarning``);
the distinct stacks are printed, then one line: ``N synchronising sites in VramMonitor's hooks``. Exits 0 whatever N is.

    python scripts/sync_sites.py                 # on a CUDA machine
    python scripts/sync_sites.py --adamw         # AdamW instead of SGD: its state copied into the replay
    python scripts/sync_sites.py --error         # "error" as the test: the traceback of what escapes fit
    python scripts/sync_sites.py --replays-off   # no preflight, no replay: the test's settings under the suite
    python scripts/sync_sites.py --cpu-dry-run   # on the CPU, no sync mode (there is none): trains, prints 0

The stacks are de-duplicated whole, from the monitor's hook (``callback.py``) down to the call that synchronised.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_vram import VramMonitor

# The test's own model, data and optimizers (tests/models.py), so that what this trains is what the test trains.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader  # type: ignore[import-not-found]  # tests/ is not type-checked

SYNC_MESSAGE = "called a synchronizing CUDA operation"
"""What torch's warning says (c10/cuda's ``warn_or_error_on_sync``)."""
CALLBACK = "lightning_vram/callback.py"
"""A site's stack is printed from the monitor's hook on (Lightning's frames above it are the same for every site)."""


class SyncMode(pl.Callback):
    """Sets ``torch.cuda.set_sync_debug_mode(mode)`` in each step hook (one goes before the monitor, one after)."""

    def __init__(self, mode: str, on: bool) -> None:
        self.mode, self.on = mode, on

    def _set(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode(self.mode)

    def on_train_batch_start(self, *_: Any) -> None:
        self._set()

    def on_before_backward(self, *_: Any) -> None:
        self._set()

    def on_before_optimizer_step(self, *_: Any) -> None:
        self._set()

    def on_train_batch_end(self, *_: Any) -> None:
        self._set()


@contextmanager
def sync_warnings() -> Iterator[dict[tuple[str, ...], int]]:
    """Every synchronisation warning while it lasts, counted by its Python stack (``path:line in function``).

    Caught at ``warnings._showwarnmsg``, which Python's warning machinery calls before ``showwarning``: the replay
    replaces ``showwarning`` while it runs (it silences the user's step's warnings), which would hide its own.
    """
    sites: dict[tuple[str, ...], int] = {}
    shown = warnings._showwarnmsg  # type: ignore[attr-defined]  # private, present in CPython 3.8 to 3.14

    def show(message: warnings.WarningMessage) -> None:
        if SYNC_MESSAGE not in str(message.message):
            shown(message)
            return
        frames = traceback.extract_stack()[:-1]
        entered = next((i for i, frame in enumerate(frames) if frame.filename.endswith(CALLBACK)), 0)
        stack = tuple(f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in frames[entered:])
        sites[stack] = sites.get(stack, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # each occurrence reaches it, not only a location's first
        warnings._showwarnmsg = show  # type: ignore[attr-defined]
        try:
            yield sites
        finally:
            warnings._showwarnmsg = shown  # type: ignore[attr-defined]


def train(cpu: bool, adamw: bool, steps: int, mode: str, replays: bool = True) -> dict[tuple[str, ...], int]:
    """Fit the test's configuration under sync debug ``mode``; the synchronisation sites seen in the monitor's hooks.

    Under ``"error"`` (as the test) the first synchronisation raises where the monitor does not catch it: its
    traceback is printed, and the sites are those the monitor caught and went on from.
    """
    # Without replays, as the test runs under tests/conftest.py (its tier turns them off): no preflight, no replay.
    off: dict[str, Any] = {} if replays else {"replay_budget_seconds": 0.0, "preflight": False}
    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=2, log_every_n_steps=1, console_summary=False, **off
    )
    root = Path(tempfile.mkdtemp(prefix="sync_sites_"))
    trainer = pl.Trainer(
        accelerator="cpu" if cpu else "gpu",
        devices=1,
        max_steps=steps,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(root),
        callbacks=[SyncMode(mode, on=not cpu), monitor, SyncMode("default", on=not cpu)],
    )
    with sync_warnings() as sites:
        try:
            module = Classifier(cnn_net(), OPTIMIZERS["adamw" if adamw else "sgd"])
            trainer.fit(module, loader(dataset_for("cnn"), batch_size=64))
        except RuntimeError:
            if SYNC_MESSAGE not in traceback.format_exc():
                raise
            print("fit raised, as the test does:")
            traceback.print_exc(file=sys.stdout)
        finally:
            if not cpu:
                torch.cuda.set_sync_debug_mode("default")
    report = monitor.report
    print(f"trained {report.steps if report is not None else 'no report'} steps; files in {root}")
    return sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="train on the CPU without a sync mode (nothing is checked; prints 0)"
    )
    parser.add_argument("--adamw", action="store_true", help="AdamW instead of SGD")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6, as the test)")
    parser.add_argument("--error", action="store_true", help='sync mode "error" (as the test) instead of "warn"')
    parser.add_argument(
        "--replays-off", action="store_true", help="no preflight and no replay, as the test runs under the suite"
    )
    arguments = parser.parse_args()
    if not arguments.cpu_dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run it with --cpu-dry-run")
    device = "cpu (dry run)" if arguments.cpu_dry_run else torch.cuda.get_device_name()
    optimizer = "AdamW" if arguments.adamw else "SGD"
    mode = "error" if arguments.error else "warn"
    shown = "none (no CUDA)" if arguments.cpu_dry_run else mode
    replays = "off" if arguments.replays_off else "on"
    print(
        f"torch {torch.__version__}, lightning {lightning.__version__}, {device}, {optimizer},"
        f" sync mode {shown}, replays {replays}, {arguments.steps} steps"
    )
    sites = train(arguments.cpu_dry_run, arguments.adamw, arguments.steps, mode, not arguments.replays_off)
    for number, (stack, count) in enumerate(sites.items(), start=1):
        print(f"\n--- site {number}: {count} time(s)")
        print("\n".join(f"    {frame}" for frame in stack))
    checked = " (a CPU dry run: nothing was checked)" if arguments.cpu_dry_run else ""
    print(f"\n{len(sites)} synchronising sites in VramMonitor's hooks{checked}")


if __name__ == "__main__":
    main()
