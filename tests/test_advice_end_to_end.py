"""Advice from real CPU training runs: each setup gets the advice its measurements support, and only that."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import OPTIMIZERS, Classifier, ScriptedClock, SlowToLoad, TimedClassifier, dataset, loader, mlp, trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import Dataset

from lightning_vram import Report, VramMonitor, VramSession
from lightning_vram.measure import setup as machine_setup
from lightning_vram.measure.setup import training_setup
from lightning_vram.render.tensorboard import MONITOR_RUN

# The advice of real runs, its figures and its words: advice the replay informs.
pytestmark = pytest.mark.replay


def fit(
    tmp_path: Path,
    module: Classifier,
    data: Dataset[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    max_steps: int = 12,
    **trainer_options: object,
) -> Report:
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=5, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=max_steps, **trainer_options).fit(module, loader(data, batch_size))
    assert monitor.report is not None
    return monitor.report


def ids(report: Report) -> set[str]:
    return {advice.id for advice in report.advice}


def test_data_starved_run_gets_dataloader_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 16 samples of 5 ms each: 80 ms of loading per batch against a millisecond of work, on a scripted clock; eight
    # cores, whatever this machine has (with one per device the rule holds back: no spare core for a worker).
    monkeypatch.setattr(machine_setup, "cpu_cores", lambda: 8)
    clock = ScriptedClock()
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=5, console_summary=False, clock=clock)
    module = TimedClassifier(mlp(512, 4), clock, seconds=0.001)
    data = SlowToLoad(dataset(512, 16 * 64), clock, seconds=0.005)
    trainer(tmp_path, [monitor], max_steps=14).fit(module, loader(data, batch_size=16))
    starved = monitor.report
    assert starved is not None
    assert starved.timing.data_wait_fraction == pytest.approx(0.080 / 0.081)
    assert "dataloader-workers" in ids(starved)
    advice = next(item for item in starved.advice if item.id == "dataloader-workers")
    assert "num_workers=0" in advice.evidence and advice.estimated_saving_seconds is not None
    assert "pin-memory" not in ids(starved)  # CPU training: nothing to pin for


def timed_report(waits_and_work: list[tuple[float, float]], cores: int = 8) -> Report:
    """A session over real training steps of a tiny model whose data wait and work take the given seconds, on
    ``cores`` CPU cores per device."""
    clock = ScriptedClock()
    model = nn.Linear(8, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = loader(dataset(8, 128), batch_size=4)  # 32 batches, num_workers=0
    session = VramSession(console_summary=False, recent_steps=8, clock=clock)
    # Eight cores per device unless told, whatever this machine has: the advice suggests 7 workers.
    session.start(
        model,
        [optimizer],
        setup=lambda: replace(training_setup(model, [optimizer], dataloaders=data), cpu_cores_per_device=cores),
    )
    batches = iter(data)
    for wait, work in waits_and_work:
        inputs, targets = next(batches)
        clock.now += wait
        session.batch_start((inputs, targets))
        loss = nn.functional.cross_entropy(model(inputs), targets)
        session.before_backward()
        loss.backward()
        session.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        clock.now += work
        session.batch_end()
    report = session.finish()
    assert report is not None
    return report


def test_dataloader_workers_fires_on_a_sustained_wait() -> None:
    # 30 ms waiting and 10 ms working per step: 75% of every step; the first batch has no wait to time.
    report = timed_report([(0.030, 0.010)] * 12)
    assert report.summary.timed_steps == 11
    assert report.timing.data_wait_fraction == pytest.approx(0.75)
    advice = next(item for item in report.advice if item.id == "dataloader-workers")
    assert "num_workers=7, persistent_workers=True" in advice.title
    assert advice.estimated_saving_seconds == pytest.approx(0.030)
    assert "data wait is 75.0% of step time over the run and 75.0% recently (11 timed steps), about 30.0 ms" in (
        advice.evidence
    )


def test_dataloader_workers_needs_a_spare_core_beside_the_training_process() -> None:
    # The same 75% wait with one core per device (two DDP ranks on two cores): a worker would take the training
    # process's core. Silent, and the report says why.
    report = timed_report([(0.030, 0.010)] * 12, cores=1)
    assert report.timing.data_wait_fraction == pytest.approx(0.75)
    assert "dataloader-workers" not in ids(report)
    reasons = {item.id: item.reason for item in report.not_advised}
    assert reasons["dataloader-workers"] == (
        "more DataLoader workers: data wait is 75.0% of step time, but the machine has 1 CPU core per device: no"
        " spare core for a worker, which would share the training process's core (the wait may be processes"
        " contending for cores, not loading)"
    )
    assert "dataloader-workers" in ids(timed_report([(0.030, 0.010)] * 12, cores=2))  # one spare core: one worker


@pytest.mark.parametrize(
    ("case", "waits_and_work"),
    [
        # Fast data: 1 ms of a 21 ms step (4.8%).
        ("fast data", [(0.001, 0.020)] * 12),
        # Lightning's own loop between batches: 60% of a 2.5 ms step, but 1.5 ms: no DataLoader setting removes it.
        ("tiny steps", [(0.0015, 0.001)] * 12),
        # A slow first epoch (30 ms waits), then 12 steps fed in time: the recent window (8 steps) does not agree.
        ("slow start", [(0.030, 0.010)] * 12 + [(0.0005, 0.010)] * 12),
        # Too few timed steps to tell.
        ("few steps", [(0.030, 0.010)] * 10),
    ],
)
def test_dataloader_workers_stays_silent(case: str, waits_and_work: list[tuple[float, float]]) -> None:
    report = timed_report(waits_and_work)
    assert report.summary.timed_steps == len(waits_and_work) - 1
    assert "dataloader-workers" not in ids(report), case


def test_deep_out_of_place_mlp_at_large_batch(tmp_path: Path) -> None:
    report = fit(tmp_path, Classifier(mlp(256, 8)), dataset(256, 2048), batch_size=512, max_steps=4)
    assert {"activation-checkpointing", "inplace-activations"} <= ids(report)
    inplace = next(item for item in report.advice if item.id == "inplace-activations")
    assert inplace.estimated_saving_bytes == 8 * 512 * 256 * 4  # each LeakyReLU's saved input
    relu = fit(tmp_path, Classifier(mlp(256, 8, activation=nn.ReLU)), dataset(256, 2048), batch_size=512, max_steps=4)
    assert "inplace-activations" not in ids(relu)  # ReLU saves its output already: inplace frees no saved tensor
    assert "optimizer-state" not in ids(report)
    checkpointing = next(item for item in report.advice if item.id == "activation-checkpointing")
    assert "segment = self.network[start:end]" in checkpointing.detail
    assert checkpointing.estimated_saving_bytes is not None and report.peak is not None
    assert checkpointing.estimated_saving_bytes >= 0.1 * report.peak.peak_bytes


def test_inplace_activations_get_no_inplace_advice(tmp_path: Path) -> None:
    report = fit(tmp_path, Classifier(mlp(256, 8, inplace=True)), dataset(256, 2048), batch_size=512, max_steps=4)
    assert "inplace-activations" not in ids(report)


def test_parameter_heavy_adam_at_batch_two(tmp_path: Path) -> None:
    module = Classifier(mlp(1024, 3), OPTIMIZERS["adam"])
    report = fit(tmp_path, module, dataset(1024, 64), batch_size=2, max_steps=4)
    assert "optimizer-state" in ids(report)
    assert "activation-checkpointing" not in ids(report)
    assert report.peak is not None and report.peak.breakdown is not None
    state = next(item for item in report.advice if item.id == "optimizer-state")
    assert state.estimated_saving_bytes == int(report.peak.breakdown.optimizer_state * 0.75)


def test_momentum_run_gets_stale_gradients_and_adam_run_does_not(tmp_path: Path) -> None:
    # Adam's step holds its foreach temporaries beside the gradients and its state: the live peak is in the optimizer
    # step, which freeing last step's gradients before forward does not lower, so the rule is silent there.
    adam = Classifier(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), OPTIMIZERS["adam"])
    report = fit(tmp_path / "adam", adam, dataset(256, 512), batch_size=64, max_steps=4)
    assert report.peak is not None and report.peak.phase.value == "optimizer"
    assert "stale-gradients" not in ids(report)
    module = Classifier(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), OPTIMIZERS["sgd_momentum"])
    report = fit(tmp_path / "momentum", module, dataset(256, 512), batch_size=64, max_steps=4)
    assert "stale-gradients" in ids(report)
    assert report.peak is not None and report.peak.breakdown is not None
    assert report.peak.phase.value == "forward"
    advice = next(item for item in report.advice if item.id == "stale-gradients")
    assert advice.estimated_saving_bytes is not None
    assert 0 < advice.estimated_saving_bytes <= report.peak.breakdown.gradients


def test_advice_text_read_back_from_tensorboard(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    data = loader(dataset(256, 512 * 2), batch_size=512)  # 2 batches per epoch
    trainer(tmp_path, [monitor], max_epochs=2, max_steps=-1, logger=logger).fit(Classifier(mlp(256, 8)), data)
    events = EventAccumulator(str(Path(logger.log_dir) / MONITOR_RUN), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("vram/advice/text_summary")
    assert [event.step for event in texts] == [2, 4]  # each epoch end; the last one's is the report's, once
    final = texts[-1].tensor_proto.string_val[0].decode()
    assert monitor.report is not None and monitor.report.advice
    for advice in monitor.report.advice:
        assert advice.title in final
        assert advice.evidence in final
    markdown = (Path(logger.log_dir) / "vram_report.md").read_text()
    assert markdown.count("### ") - markdown.count("### Not advised") == len(monitor.report.advice)
