"""DataLoader workers: the step waits for data a tenth of the time or more, sustained, with spare cores.

A spare core is one beside the training process's own: with one core per device (two DDP ranks on two cores), a
worker takes its process's core, and the measured wait is as likely the ranks contending for cores as loading (a new
user's trial: 32.1% and 26.7% in two DDP runs, 2.8% and 1.3% in two others, with the same in-memory dataset). The
rule needs two cores per device or more, and says so where it holds back.
"""

from __future__ import annotations

from lightning_vram.advice.rules.base import (
    DATA_WAIT_WORKERS_SHARE,
    Rule,
    data_wait_reason,
    no_changes,
    sustained_data_wait,
)
from lightning_vram.records import Advice, AdviceId, RunSummary, Severity, Simulation, TrainingSetup
from lightning_vram.units import format_percent

ID = AdviceId.DATALOADER_WORKERS


def suggested_num_workers(cpu_cores_per_device: int) -> int:
    """Workers for one device's DataLoader: the cores it has, one left for the training process, at most 8.

    >>> suggested_num_workers(16), suggested_num_workers(2), suggested_num_workers(1)
    (8, 1, 0)
    """
    return max(0, min(8, cpu_cores_per_device - 1))


def dataloader_workers(
    summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None
) -> Advice | None:
    """The step waits for data a tenth of the time or more, sustained, with spare cores for workers."""
    if setup.num_workers is None or not sustained_data_wait(summary, DATA_WAIT_WORKERS_SHARE):
        return None
    workers = suggested_num_workers(setup.cpu_cores_per_device)
    if workers <= setup.num_workers:
        return None
    wait = summary.data_wait_fraction or 0.0
    step = summary.step_seconds_median or 0.0
    pin = ", pin_memory=True" if summary.on_cuda else ""
    loader_code = (
        f"```python\nDataLoader(dataset, ..., num_workers={workers}, persistent_workers=True{pin})"
        "  # `...`: your own arguments, unchanged\n```"
    )
    iterable = setup.iterable_dataset and workers > 1
    return Advice(
        id=ID,
        severity=Severity.WARNING,
        title=f"Load data in parallel: DataLoader(num_workers={workers}, persistent_workers=True)",
        detail=(
            "Each step waits while the main process loads the next batch. Worker processes load batches ahead"
            " of time; persistent workers are not restarted every epoch. "
            + (_iterable_text(workers, setup.loader_batch_size) if iterable else "")
            + "The same computation, but not the same random numbers: random augmentations in the dataset draw"
            " from each worker's own generator (seeded from the torch RNG when the workers start) instead of"
            " the main process's, and persistent workers draw that seed once, not every epoch, so from the"
            " second epoch shuffling and Dropout see another stream. Training is another random draw, not the"
            " same model bit for bit (without persistent workers and random augmentation, it is, unless a"
            " sampler of yours draws from the torch RNG as it yields indices: the workers read it ahead, so"
            " Dropout draws at other points of the stream from the first step; a torch.Generator of its own"
            " keeps it apart)."
            " Persistent workers also keep the copy of the dataset they started with: where your code changes"
            " the dataset between epochs (a curriculum's level, a `set_epoch`), they go on loading the first"
            " epoch's samples, another computation: leave persistent_workers out there.\n"
            + ("Then add" if iterable else "Add")
            + " the two arguments to your DataLoader and keep every other as it is: shuffle, sampler,"
            " collate_fn and drop_last decide which samples each step sees.\n" + loader_code
        ),
        evidence=(
            f"data wait is {format_percent(wait)} of step time over the run and"
            f" {format_percent(summary.recent_data_wait_fraction)} recently ({summary.timed_steps} timed steps), about"
            f" {1000 * step * wait:.1f} ms per step;"
            f" num_workers={setup.num_workers}, {setup.cpu_cores_per_device} CPU cores per device"
        ),
        estimated_saving_bytes=None,
        estimated_saving_seconds=step * wait,
    )


def _iterable_text(workers: int, batch_size: int | None) -> str:
    """What workers do to an ``IterableDataset``, and its split by runs of ``batch_size``: one process's batches.

    Each worker runs its own copy of the dataset's ``__iter__``: a stream not split by worker is yielded whole by
    each of them, so an epoch holds every batch ``workers`` times (torch's ``IterableDataset`` documentation). Split
    sample by sample (every ``workers``-th), each worker batched its own share: other batches, in another order, and
    under ``drop_last`` each worker dropped its own last partial batch (12 samples, batches of 4, 2 workers: 8 seen
    an epoch). Split by runs of ``batch_size`` samples, worker ``k`` holds batches ``k``, ``k + workers``...; the
    DataLoader takes the workers' batches in turn, so the batches, their order and what ``drop_last`` drops are those
    of one process. ``batch_size``: the DataLoader's (``None``: the stream yields batches, a run of one).
    """
    run = batch_size or 1
    return (
        f"Your dataset is an IterableDataset: each of the {workers} workers runs its own copy of its `__iter__`, so"
        " unless `__iter__` splits the stream by `torch.utils.data.get_worker_info()`, every worker yields every"
        f" sample and an epoch holds each batch {workers} times. Split it as below, by runs of the DataLoader's"
        f" batch_size ({run}): each worker takes every {workers}th batch's samples and the DataLoader takes the"
        " workers' batches in turn, so every batch, their order and what drop_last drops stay as in one process"
        " (split sample by sample instead, each worker would batch its own share: other batches, and under drop_last"
        " each worker's last partial batch dropped).\n"
        "```python\n"
        "def __iter__(self):  # your IterableDataset's, split by worker\n"
        "    info = torch.utils.data.get_worker_info()\n"
        "    shard, shards = (info.id, info.num_workers) if info is not None else (0, 1)\n"
        f"    batch_size = {run}  # your DataLoader's batch_size: if you change it, change this too\n"
        "    for index, sample in enumerate(self.samples()):  # `self.samples()`: your own iteration, unchanged\n"
        "        if index // batch_size % shards == shard:\n"
        "            yield sample\n"
        "```\n"
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why more DataLoader workers are not advised: the data-wait share, no spare core, or the workers there already."""
    if setup.num_workers is None:
        return None
    if sustained_data_wait(summary, DATA_WAIT_WORKERS_SHARE) and suggested_num_workers(setup.cpu_cores_per_device) < 1:
        return (
            f"more DataLoader workers: data wait is {format_percent(summary.data_wait_fraction or 0.0)} of step time,"
            f" but the machine has {setup.cpu_cores_per_device} CPU core per device: no spare core for a worker, which"
            " would share the training process's core (the wait may be processes contending for cores, not loading)"
        )
    if sustained_data_wait(summary, DATA_WAIT_WORKERS_SHARE):
        return (
            f"num_workers={setup.num_workers} already, as many as {setup.cpu_cores_per_device} CPU cores per device"
            " leave room for"
        )
    reason = data_wait_reason(summary, DATA_WAIT_WORKERS_SHARE)
    return f"more DataLoader workers: {reason}" if reason is not None else None


RULE = Rule(ID, dataloader_workers, no_changes, why_not)
