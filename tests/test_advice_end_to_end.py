"""Advice from real CPU training runs: each setup gets the advice its measurements support, and only that."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from models import OPTIMIZERS, Classifier, loader, trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_vram import Report, VramMonitor


def dataset(width: int, samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, width, generator=generator), torch.randint(0, 10, (samples,)))


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample takes ``delay_seconds`` to load, like decoding an image from disk."""

    def __init__(self, data: TensorDataset, delay_seconds: float) -> None:
        self.data = data
        self.delay_seconds = delay_seconds

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_seconds)
        inputs, target = self.data[index]
        return inputs, target


def mlp(width: int, depth: int, inplace: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(inplace=inplace)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


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


def test_data_starved_run_gets_dataloader_workers_and_fast_data_does_not(tmp_path: Path) -> None:
    data = dataset(512, 16 * 64)
    starved = fit(
        tmp_path, Classifier(mlp(512, 4)), SlowDataset(data, delay_seconds=0.005), batch_size=16, max_steps=14
    )
    assert starved.timing.data_wait_fraction is not None and starved.timing.data_wait_fraction > 0.5
    assert "dataloader-workers" in ids(starved)
    advice = next(item for item in starved.advice if item.id == "dataloader-workers")
    assert "num_workers=0" in advice.evidence and advice.estimated_saving_seconds is not None
    fast = fit(tmp_path, Classifier(mlp(512, 4)), data, batch_size=16, max_steps=14)
    assert fast.timing.data_wait_fraction is not None and fast.timing.step_seconds_median is not None
    # Fast data still leaves Lightning's own loop between batches: well under 2 ms a step, and no advice.
    assert fast.timing.data_wait_fraction * fast.timing.step_seconds_median < 0.002
    assert "dataloader-workers" not in ids(fast)
    assert "pin-memory" not in ids(starved)  # CPU training: nothing to pin for


def test_deep_out_of_place_mlp_at_large_batch(tmp_path: Path) -> None:
    report = fit(tmp_path, Classifier(mlp(256, 8)), dataset(256, 2048), batch_size=512, max_steps=4)
    assert {"activation-checkpointing", "inplace-activations"} <= ids(report)
    assert "optimizer-state" not in ids(report)
    checkpointing = next(item for item in report.advice if item.id == "activation-checkpointing")
    assert "checkpoint_sequential(self.network" in checkpointing.detail
    assert checkpointing.estimated_saving_bytes is not None and report.peak is not None
    assert checkpointing.estimated_saving_bytes >= 0.1 * report.peak.peak_bytes


def test_inplace_relus_get_no_inplace_advice(tmp_path: Path) -> None:
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


def test_default_adam_run_gets_stale_gradients(tmp_path: Path) -> None:
    module = Classifier(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)), OPTIMIZERS["adam"])
    report = fit(tmp_path, module, dataset(256, 512), batch_size=64, max_steps=4)
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
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("vram/advice/text_summary")
    assert [event.step for event in texts] == [2, 4, 4]  # each epoch end, then train end
    final = texts[-1].tensor_proto.string_val[0].decode()
    assert monitor.report is not None and monitor.report.advice
    for advice in monitor.report.advice:
        assert advice.title in final
        assert advice.evidence in final
    assert (Path(logger.log_dir) / "vram_report.md").read_text().count("### ") == len(monitor.report.advice)
