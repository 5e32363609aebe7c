"""What the callback reads from Lightning: set-up, publishers of its loggers, logging step, collectives, log dir.

With callback.py, the only module that imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl
import torch

from lightning_vram.measure.setup import training_setup
from lightning_vram.records import TrainingSetup
from lightning_vram.render.files import Location, as_location, join
from lightning_vram.render.publishers import publisher_for, run_dir_of
from lightning_vram.render.publishing import Publisher
from lightning_vram.session.assembly import Gather


def trainer_setup(trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainingSetup:
    """How the Trainer trains ``pl_module``, for the advice rules."""
    return training_setup(
        pl_module,
        trainer.optimizers,
        dataloaders=trainer.train_dataloader,
        precision=str(trainer.precision),
        automatic_optimization=pl_module.automatic_optimization,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        devices_per_node=trainer.num_devices,
        world_size=trainer.world_size,
        strategy=type(trainer.strategy).__name__,
        own_zero_grad=type(pl_module).optimizer_zero_grad is not pl.LightningModule.optimizer_zero_grad,
    )


def trainer_publishers(trainer: pl.Trainer) -> list[Publisher]:
    """One publisher per logger of the Trainer, in its order (see :func:`~lightning_vram.publisher_for`).

    None but on global rank zero.
    """
    if not trainer.is_global_zero:
        return []
    return [publisher_for(logger) for logger in trainer.loggers]


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own logging uses (``self.log``, ``LearningRateMonitor``, ``DeviceStatsMonitor``).

    That is the fit loop's count of batches that stepped, a private attribute of Lightning 2 (read here alone);
    ``global_step`` (the optimizer steps) where it is missing.
    """
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(epoch_loop, "_batches_that_stepped", None)
    return step if isinstance(step, int) else trainer.global_step


def strategy_gather(trainer: pl.Trainer) -> Gather:
    """Every rank's list of numbers through the strategy's all_gather (NaN for not measured). A collective."""

    def gather(values: list[float]) -> list[list[float]]:
        local = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local)
        rows: list[list[float]] = gathered.reshape(trainer.world_size, len(values)).cpu().tolist()
        return rows

    return gather


def strategy_barrier(trainer: pl.Trainer) -> Callable[[], None]:
    """The strategy's barrier: every rank waits there for the others. A collective.

    At train end rank zero writes the report files while the others wait: a rank that leaves first tears down its side
    of the process group under rank zero (gloo aborts the process then).
    """
    return lambda: trainer.strategy.barrier("vram_report_written")


def report_dir(trainer: pl.Trainer, publishers: Sequence[Publisher], monitor_index: int = 0) -> Location | None:
    """Where the report files go; none under fast_dev_run.

    The first logger's own run folder (``log_dir`` for TensorBoard and CSV, the run's files folder for W&B, the run's
    artifact folder for MLflow with a local store, ``<save_dir>/vram_<experiment key>`` for Comet), else the Trainer's
    ``log_dir``, else ``default_root_dir``.

    Lightning turns logging off for ``fast_dev_run``; the monitor writes no files then either. A remote log dir
    (``TensorBoardLogger("s3://...")``) stays its URL, written through fsspec as Lightning writes there. The second
    and later monitors of one Trainer (``monitor_index`` >= 1) write into ``vram_monitor_<index>`` below it.
    """
    if getattr(trainer, "fast_dev_run", False):  # set by the Trainer at run time (not in its annotations)
        return None
    root = as_location(str(trainer.log_dir or trainer.default_root_dir))
    directory = run_dir_of(publishers, root)
    return directory if monitor_index == 0 else join(directory, f"vram_monitor_{monitor_index}")


def trainer_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """The Trainer's callbacks, in the order it calls them."""
    callbacks: list[pl.Callback] = getattr(trainer, "callbacks", [])  # set at run time (not in its annotations)
    return callbacks


def log_interval(trainer: pl.Trainer) -> int | None:
    """The Trainer's ``log_every_n_steps``; ``None`` where logging is off (0, a barebones Trainer)."""
    # Lightning sets this plain attribute on every Trainer.
    return int(getattr(trainer, "log_every_n_steps", 50)) or None
