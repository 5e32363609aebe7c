"""Predicting a step without training: the public ``predict`` and the batch-size search behind its fit table."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from models import OPTIMIZERS, Classifier, trainer
from replay_models import ARCHITECTURES, counted_step
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramMonitor, predict
from lightning_vram.advice.rules.batch_size_headroom import batch_size_headroom
from lightning_vram.measure.setup import training_setup
from lightning_vram.measure.tensors import time_major
from lightning_vram.predict import FAKE_CUDA_NOTE
from lightning_vram.prediction.devices import BATCH_SAFETY_MARGIN, COMMON_GPUS
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.search import MAX_BATCH_SIZE, largest_batch_that_fits
from lightning_vram.records import BatchSizeChange, DeviceInfo, Phase, ReplayedStep
from lightning_vram.units import format_bytes

# predict(): the step replayed before training.
pytestmark = pytest.mark.replay

CONTEXT = 300 * 1024**2


def test_prediction_equals_the_step_the_monitor_counts(tmp_path: Path) -> None:
    architecture = ARCHITECTURES["resnet"]
    torch.manual_seed(0)
    module = architecture.build()
    untrained = copy.deepcopy(module.state_dict())
    batch = next(iter(torch.utils.data.DataLoader(architecture.data(8), batch_size=8)))
    prediction = predict(module, batch, device_type="cpu", fit_table=False)
    assert prediction.skipped is None and prediction.step is not None and prediction.fit == ()
    assert all(parameter.grad is None for parameter in module.parameters())  # nothing ran on the module itself
    assert all(torch.equal(value, untrained[key]) for key, value in module.state_dict().items())
    measured, _ = counted_step(tmp_path, module, architecture.data(64), 8)
    for phase, counted in measured.phases.items():
        predicted = prediction.step.phases[phase].breakdown
        assert predicted is not None
        assert (predicted.parameters, predicted.gradients, predicted.optimizer_state, predicted.activations) == (
            counted.parameters,
            counted.gradients,
            counted.optimizer_state,
            counted.activations,
        )


def test_fit_table_gives_the_largest_batch_whose_replayed_peak_fits_each_gpu() -> None:
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    module = Classifier(nn.Sequential(nn.Linear(64, 65536), nn.ReLU(), nn.Linear(65536, 10)), OPTIMIZERS["adam"])
    prediction = predict(module, batch, device_type="cpu", cuda_context_bytes=CONTEXT)
    assert prediction.step is not None and len(prediction.fit) == len(COMMON_GPUS)
    assert [row.device for row in prediction.fit] == [name for name, _ in COMMON_GPUS]

    def peak(size: int) -> int:
        replayed = Predictor(module, None, batch, warm_up=True).replay(BatchSizeChange(size))
        assert isinstance(replayed, ReplayedStep)
        return replayed.peak.peak_bytes

    for row in prediction.fit:
        budget = int(row.capacity_bytes * (1 - BATCH_SAFETY_MARGIN)) - CONTEXT
        assert peak(row.max_batch_size) <= budget
        if row.at_least:  # the search stopped at its bound: a larger batch may fit too, and the row says so
            assert row.max_batch_size == MAX_BATCH_SIZE
        else:
            assert budget < peak(row.max_batch_size + 1)
    sizes = [row.max_batch_size for row in prediction.fit]
    assert sizes == sorted(sizes) and sizes[0] > 16
    assert any(not row.at_least for row in prediction.fit)


def test_cuda_prediction_without_a_cuda_device_replays_on_the_cpu_and_says_so() -> None:
    module = Classifier(nn.Linear(8, 10), OPTIMIZERS["sgd"])
    prediction = predict(module, (torch.randn(4, 8), torch.randint(0, 10, (4,))), fit_table=False)
    assert prediction.step is not None
    cublas = [note for note in prediction.notes if note.startswith(("cuBLAS workspaces:", "cuBLASLt workspaces:"))]
    if torch.cuda.is_available():
        assert prediction.step.device_type == "cuda" and prediction.notes == (*cublas,) and len(cublas) == 2
    elif torch.backends.cuda.is_built():  # a CUDA build fakes CUDA tensors without a device (docs/fake-cuda.md)
        assert prediction.step.device_type == "cuda" and prediction.notes == (FAKE_CUDA_NOTE, *cublas)
        assert len(cublas) == 2 and "compute capability unknown" in cublas[0]  # no device to ask
    else:
        assert prediction.step.device_type == "cpu"
        assert any("replayed on the CPU" in note for note in prediction.notes)
        # The CPU's replay takes no library workspaces, which a CUDA step holds: the note says they are left out.
        assert not cublas and any("cuBLASLt's workspaces are not counted" in note for note in prediction.notes)


class ReadsLoss(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss.item())
        return loss


def test_prediction_that_cannot_replay_says_why() -> None:
    prediction = predict(ReadsLoss(nn.Linear(8, 10)), (torch.randn(4, 8), torch.randint(0, 10, (4,))))
    assert prediction.step is None and prediction.fit == ()
    assert prediction.skipped is not None and ".item()" in prediction.skipped
    line = ReadsLoss.training_step.__code__.co_firstlineno + 2  # the self.log(..., loss.item()) line
    assert f"in forward at {__file__}:{line} (training_step)" in prediction.skipped
    assert "A value read for logging can stay a tensor" in prediction.skipped


def test_a_value_read_inside_the_optimizer_names_its_place_and_not_logging() -> None:
    # Adafactor reads its step count and norms with .item() inside torch.optim: no logging change replays it.
    module = Classifier(nn.Linear(8, 10), optimizer=partial(torch.optim.Adafactor, lr=1e-2))
    prediction = predict(module, (torch.randn(4, 8), torch.randint(0, 10, (4,))), device_type="cpu", fit_table=False)
    assert prediction.step is None and prediction.skipped is not None
    assert "in the optimizer step at torch/optim/_adafactor.py:" in prediction.skipped
    assert "in library code the step calls" in prediction.skipped
    assert "logging" not in prediction.skipped


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"module": "model"}, TypeError, "module must be a torch.nn.Module"),
        ({"module": nn.Linear(8, 10)}, TypeError, "got Linear, which has no training_step and no configure_optimizers"),
        (
            {"cuda_context_bytes": -1},
            ValueError,
            "cuda_context_bytes must be an int >= 0 and at most the largest GPU's",
        ),
        ({"cuda_context_bytes": 10**30}, ValueError, f"memory ({max(m for _, m in COMMON_GPUS)}), got {10**30}"),
        ({"cuda_context_bytes": True}, ValueError, "cuda_context_bytes must be an int >= 0, got True (bool)"),
        ({"fit_table": "no"}, ValueError, "fit_table must be True or False, got 'no' (str)"),
        ({"fit_table": None}, ValueError, "fit_table must be True or False, got None (NoneType)"),
        ({"precision": "fp99"}, ValueError, "precision must be one of 32-true, 32, bf16-mixed, 16-mixed, bf16-true,"),
        ({"precision": 16}, ValueError, "16-true, 64-true, 64, got 16 (int)"),
        (
            {"budget_seconds": float("inf")},
            ValueError,
            "budget_seconds must be a number of seconds > 0, finite, got inf",
        ),
        ({"device_type": "tpu"}, ValueError, "device_type must be 'cuda' or 'cpu', got 'tpu'"),
        ({"device_type": "cpu:abc"}, ValueError, "device_type must be 'cuda' or 'cpu' (with an index: 'cuda:1'), got"),
        ({"batch": None}, TypeError, "batch must be one batch as training_step receives it (a tensor, or a tuple,"),
    ],
)
def test_bad_arguments_name_what_they_must_be(arguments: dict[str, Any], error: type[Exception], message: str) -> None:
    call: dict[str, Any] = {"module": Classifier(nn.Linear(8, 10)), "batch": (torch.randn(2, 8),), **arguments}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        predict(call.pop("module"), call.pop("batch"), **call)


def test_search_finds_the_exact_largest_batch() -> None:
    calls: list[int] = []

    def peak(size: int) -> int:
        calls.append(size)
        return 10_000 + 300 * size + (512 if size > 1000 else 0)  # almost linear

    assert largest_batch_that_fits(peak, budget_bytes=400_000, start=32) == 1298
    assert len(calls) == len(set(calls))  # every batch size replayed once
    assert len(calls) < 20
    assert largest_batch_that_fits(peak, budget_bytes=10_000, start=32) == 0  # even one sample does not fit
    assert largest_batch_that_fits(lambda size: 5, budget_bytes=10, start=4, limit=100) == 100  # all fit
    assert largest_batch_that_fits(lambda size: None if size > 40 else size, budget_bytes=1000, start=32) is None
    staircase = largest_batch_that_fits(lambda size: 1000 * (size // 64 + 1), budget_bytes=5000, start=8)
    assert staircase == 319  # 319 // 64 + 1 = 5 steps of 1000 bytes fit; 320 needs a sixth


def test_a_prediction_prints_as_a_short_table_and_has_a_json_form() -> None:
    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), OPTIMIZERS["adam"])
    prediction = predict(module, (torch.randn(16, 64), torch.randint(0, 10, (16,))), device_type="cpu")
    step = prediction.step
    assert step is not None and prediction.fit
    lines = str(prediction).splitlines()
    assert len(lines) < 30 and len(str(prediction)) < 2500  # not the dataclass's several-KB dump
    peak = step.peak
    assert (
        lines[0]
        == f"Prediction: cpu, 32-true, batch 16: live peak {format_bytes(peak.peak_bytes)} in {peak.phase.value}"
    )
    assert lines[1].split() == [
        "phase",
        "peak",
        "parameters",
        "gradients",
        "optimizer",
        "state",
        "activations",
        "other",
    ]
    forward = step.phases[Phase.FORWARD]
    assert forward.breakdown is not None
    assert lines[2].split()[:4] == [
        "forward",
        *format_bytes(forward.peak_bytes).split(),
        format_bytes(forward.breakdown.parameters).split()[0],
    ]
    # The context each row keeps free beside the step is named: a reader can set it against their own card's. Asked
    # for the CPU, the answer leads (the first line); the GPU rows are titled as the move they are about.
    context = format_bytes(prediction.cuda_context_bytes)
    assert prediction.cuda_context_bytes > 0
    assert lines[len(step.phases) + 2] == (
        f"On GPUs (if you move this model there): largest batch per GPU (each card's capacity less {context} of CUDA"
        " context):"
    )
    rows = lines[len(step.phases) + 4 : len(step.phases) + 4 + len(prediction.fit)]
    for row, fit in zip(rows, prediction.fit, strict=True):
        assert row.startswith(f"  {fit.device}") and row.endswith(fit.allocator_text)
        assert f" {fit.batch_text} " in row and f" {fit.expandable_text} " in row
    note_lines = [line for line in lines if line.startswith("  - ")]
    assert len(note_lines) == len(set(note_lines))  # a note both the step and the prediction carry is printed once
    data = json.loads(json.dumps(prediction.to_dict()))
    assert data["step"]["peak_bytes"] == peak.peak_bytes and data["step"]["peak_phase"] == peak.phase.value
    assert data["step"]["phases"]["forward"]["peak_bytes"] == forward.peak_bytes
    assert data["step"]["phases"]["forward"]["breakdown"]["parameters"] == forward.breakdown.parameters
    assert [row["max_batch_size"] for row in data["fit"]] == [row.max_batch_size for row in prediction.fit]
    assert [row["name"] for row in data["step"]["modules"]] == [row.name for row in step.modules]
    assert data["cuda_context_bytes"] == prediction.cuda_context_bytes and data["skipped"] is None


def test_a_prediction_for_gpus_gives_the_step_time_on_each_card_of_its_fit_table() -> None:
    from lightning_vram.prediction.timing import GPU_PEAKS, predict_step_time

    torch.manual_seed(0)
    module = Classifier(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), OPTIMIZERS["adam"])
    prediction = predict(module, (torch.randn(16, 64), torch.randint(0, 10, (16,))), device_type="cuda")
    step = prediction.step
    assert step is not None and prediction.fit
    rows = {row.device for row in prediction.fit}
    cards = [peaks for peaks in GPU_PEAKS.values() if peaks.memory_row in rows]
    assert [time.device for time in prediction.step_times] == [peaks.name for peaks in cards] and len(cards) >= 6
    for time, peaks in zip(prediction.step_times, cards, strict=True):
        assert time.seconds == predict_step_time(step, peaks).seconds > 0 and time.samples == 16
    lines = str(prediction).splitlines()
    # Asked for CUDA, replayed on the CPU where this torch can fake no CUDA tensors (a CUDA build replays on them).
    device = "cuda" if step.device_type == "cuda" else "cuda (replayed on cpu)"
    assert lines[0].startswith(f"Prediction: {device}, 32-true, batch 16: ")
    assert prediction.to_dict()["device_type"] == "cuda"
    context = format_bytes(prediction.cuda_context_bytes)  # asked for GPUs: the rows are the answer, titled plainly
    assert (
        lines[len(step.phases) + 2] == f"Largest batch per GPU (each card's capacity less {context} of CUDA context):"
    )
    start = lines.index(
        "Step time at batch 16 (roofline per op at 50% of each card's published peaks, ops one after another, not"
        " calibrated by a run):"
    )
    assert lines[start + 1].split() == ["GPU", "step", "samples/s"]
    first = prediction.step_times[0]
    assert lines[start + 2].split()[-3:] == [f"{1000 * first.seconds:.2f}", "ms", f"{first.samples_per_second:,.0f}"]
    data = json.loads(json.dumps(prediction.to_dict()))
    assert [(row["device"], row["seconds"]) for row in data["step_times"]] == [
        (time.device, time.seconds) for time in prediction.step_times
    ]
    assert data["step_times"][0]["basis"].startswith("roofline per op on ")


class TimeMajorLSTM(Classifier):
    """An LSTM classifier over time-major token ids, ``(L, B)`` as ``pad_sequence`` and ``nn.LSTM`` have them by
    default, with a label per sequence ``(B,)``."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__(nn.Linear(128, 10), OPTIMIZERS["adam"])
        self.embedding = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 128)
        self.batch_first = batch_first
        """The batch's token ids are ``(B, L)``, turned time-major here."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        output, _ = self.lstm(self.embedding(tokens.T if self.batch_first else tokens))
        return nn.functional.cross_entropy(self.network(output[-1]), labels)


def test_a_time_major_batch_gets_no_fit_table_in_batches_that_are_its_length() -> None:
    # Before: the search varied dimension 0, the sequences' length, and called it the batch: 33,951 "samples" on
    # an RTX 3060 for an LSTM at batch 32 of 64 tokens, where 33,951 sequences of 64 tokens need about twice the
    # memory of 32 sequences of 33,951 tokens.
    length, batch_size = 64, 32
    batch = (torch.randint(0, 100, (length, batch_size)), torch.randint(0, 10, (batch_size,)))
    prediction = predict(TimeMajorLSTM(), batch, device_type="cpu")
    assert prediction.skipped is None and prediction.fit == ()
    (note,) = [note for note in prediction.notes if note.startswith("fit table")]
    assert "(64, 32), starts with 64 where another, (32,), starts with 32, its second dimension" in note
    assert "(a time-major batch, whose first dimension is its length)" in note
    assert "time budget" not in note  # nothing was replayed for it
    # Replayed longer and wider, the step grows with either: what the table would have mixed up.
    longer = predict(TimeMajorLSTM(), (batch[0].repeat(2, 1), batch[1]), device_type="cpu", fit_table=False)
    assert longer.step is not None and prediction.step is not None
    assert longer.step.peak.peak_bytes > 1.8 * prediction.step.peak.peak_bytes
    # The same model fed batch-first keeps its table.
    assert predict(TimeMajorLSTM(batch_first=True), (batch[0].T.contiguous(), batch[1]), device_type="cpu").fit != ()


class BoxedImages(torch.utils.data.Dataset[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
    """Images with a detection target each, three boxes and their labels (a list of dicts beside the images)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(index)
        boxes = torch.rand(3, 4, generator=generator)
        return torch.randn(3, 16, 16, generator=generator), {"boxes": boxes, "labels": torch.tensor([index % 5] * 3)}


def stacked_images(
    samples: list[tuple[torch.Tensor, dict[str, torch.Tensor]]],
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    return torch.stack([image for image, _ in samples]), [target for _, target in samples]


class BoxClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        labels = torch.stack([target["labels"][0] for target in targets])
        return nn.functional.cross_entropy(self.head(self.network(images)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_image_batch_beside_three_boxes_keeps_its_batch_size(tmp_path: Path) -> None:
    # (8, 3, 16, 16) images beside each image's (3, 4) boxes: the boxes' 3 is the images' channels, not a batch
    # dimension past the first. Before: read as time-major, the report's batch_size was None (8 with 2 boxes).
    loader = DataLoader(BoxedImages(), batch_size=8, collate_fn=stacked_images)
    assert time_major(next(iter(loader))) is None
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(BoxClassifier(), loader)
    assert monitor.report is not None
    assert monitor.report.summary.batch_size == 8  # before: None


def test_a_time_major_run_has_no_batch_size_to_raise_or_halve(tmp_path: Path) -> None:
    # The monitor's summary took the first dimension, the length 64, for the batch of 32: on a GPU with room,
    # batch-size-headroom printed `DataLoader(dataset, ..., batch_size=N)` modelled from "now 64".
    data = TensorDataset(torch.randint(0, 100, (128, 64)), torch.randint(0, 10, (128,)))

    def time_major(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([tokens for tokens, _ in samples], 1), torch.stack([label for _, label in samples])

    loader = DataLoader(data, batch_size=32, collate_fn=time_major)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=3).fit(TimeMajorLSTM(), loader)
    assert monitor.report is not None
    summary = monitor.report.summary
    assert summary.batch_size is None
    on_a_gpu = replace(
        summary,
        device=DeviceInfo("cuda", "GPU", 0, 80 * 2**30, (8, 0)),
        gpu_utilization_mean=20.0,
        data_wait_fraction=0.0,
        cuda_context_bytes=0,
    )
    assert batch_size_headroom(on_a_gpu, training_setup(TimeMajorLSTM(), [])) is None
