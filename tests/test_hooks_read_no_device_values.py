"""The monitor's step hooks read no value of the user's tensors and copy none to the host without blocking.

On a GPU such a read waits for the device (``tests/test_gpu.py::test_monitor_hooks_never_synchronise`` turns it into
an error); here ``tests/host_reads.py`` records the same calls on the CPU. The CUDA code path runs through a
``ScriptedProbe``, with the GPU test's settings: preflight, sampled steps every other step, the in-training replay and
its fit table, logging every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from host_reads import HostReads
from lightning.pytorch.loggers import CSVLogger
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader, trainer
from scripted import MIB, scripted_steps

from lightning_vram import VramMonitor
from lightning_vram.testing import ScriptedProbe


@pytest.mark.replay
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_step_hooks_leave_the_users_values_on_the_device(tmp_path: Path, optimizer: str) -> None:
    # cnn_net holds a BatchNorm (running statistics, num_batches_tracked): its buffers are copied into each replay,
    # with AdamW's state (its moments and the host-side step) after the first step.
    probe = ScriptedProbe(scripted_steps([(300 * MIB, 350 * MIB, 400 * MIB)] * 6))
    monitor = VramMonitor(
        probe=probe, attribution_start_step=1, attribution_every_n_steps=2, log_every_n_steps=1, console_summary=False
    )
    with HostReads(monitor) as reads:
        trainer(tmp_path, [monitor], max_steps=6, logger=CSVLogger(tmp_path)).fit(
            Classifier(cnn_net(), OPTIMIZERS[optimizer]), loader(dataset_for("cnn"), batch_size=64)
        )
    report = monitor.report
    assert report is not None and report.steps == 6
    # The hooks did replay the step: the fit table is the in-training replay's, with the batch's values to read.
    assert report.simulation is not None
    sites = reads.sites(users_only=True)
    assert not sites, "\n".join(group[0].describe() for group in sites.values())


def test_the_proxy_sees_a_blocking_read_in_a_hook(tmp_path: Path) -> None:
    # The proxy itself: a hook that reads a parameter's value and copies the batch to the host is caught, with the
    # hook and the call; a non-blocking copy is not, nor a read outside the hooks.
    model = Classifier(cnn_net())
    weight = model.network[0].weight
    monitor = VramMonitor(attribution_start_step=100, console_summary=False)
    session_batch_start = monitor.session.batch_start

    def reading(batch: Any = None) -> None:
        session_batch_start(batch)
        weight.view(-1)[0].item()
        batch[0].to("cpu")
        batch[0].to("cpu", non_blocking=True)

    monitor.session.batch_start = reading  # type: ignore[method-assign]
    with HostReads(monitor) as reads:
        trainer(tmp_path, [monitor], max_steps=1).fit(model, loader(dataset_for("cnn"), batch_size=64))
        weight.view(-1)[0].item()
    calls = [(read.call, read.hook, read.users) for read in reads.reads]
    assert calls == [("Tensor.item", "on_train_batch_start", True), ("Tensor.to(cpu)", "on_train_batch_start", True)]
    assert reads.reads[0].stack[-1].startswith("lightning_vram/callback.py:")


class CopyEvent:
    """A recorded copy's event whose ``query`` says done from its ``ready_after + 1``-th poll on."""

    def __init__(self, ready_after: int) -> None:
        self.ready_after = ready_after
        self.polls = 0

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.ready_after


def test_a_batch_copy_on_its_way_is_polled_for_a_bounded_time_never_waited_on() -> None:
    """The replay polls a CUDA batch's copy (``Event.query``, no device wait) until it arrives or the time is up."""
    from lightning_vram.prediction.replay.known_values import arrived

    late = CopyEvent(ready_after=3)
    assert arrived(late, 5.0) and late.polls == 4
    never = CopyEvent(ready_after=10**9)
    assert not arrived(never, 0.01) and never.polls > 1
