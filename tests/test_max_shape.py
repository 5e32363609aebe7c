"""The largest shape the user expects (``max_shape``): the batch resized to it, predicted, and checked before step 0.

A small conv net (conv, batch norm, in-place ReLU, pooling, a linear head) trains on images of several sizes; a
small segmentation net on images with their masks. A batch resized to ``max_shape`` must be replayed as a real
batch of that shape is, and the monitor's preflight must check it before the first step.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile.harness import Case, assert_untouched
from models import Classifier, trainer
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader, Dataset

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.predict import predict
from lightning_vram.prediction.replay.batches import length_shape, resize_length, resize_shape
from lightning_vram.records import ReplayedStep
from lightning_vram.render.shapes import longest_line
from lightning_vram.testing import SCRIPTED_DEVICE, ScriptedBoundary, ScriptedProbe

# max_shape is a preflight replay of the largest shape expected.
pytestmark = pytest.mark.replay

CLASSES, BATCH, STEPS = 4, 2, 4
SIZES = [(16, 16), (24, 16), (16, 24), (24, 24)]
"""The image sizes (height, width) of the variable-size training data, one per batch in turn."""


def conv_net() -> Classifier:
    """Conv, batch norm, in-place ReLU, global pooling and a linear head: images ``(B, 3, H, W)`` of any size."""
    torch.manual_seed(0)
    return Classifier(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, CLASSES),
        )
    )


def segmenter() -> Classifier:
    """A per-pixel classifier: images ``(B, 3, H, W)`` to logits ``(B, CLASSES, H, W)``; masks ``(B, H, W)``."""
    torch.manual_seed(0)
    return Classifier(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, CLASSES, 1))
    )


def images(height: int, width: int, batch: int = BATCH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of images and their labels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch, 3, height, width, generator=generator)
    return pixels, torch.randint(0, CLASSES, (batch,), generator=generator)


def masked(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of images and their segmentation masks (a class per pixel)."""
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(BATCH, 3, height, width, generator=generator)
    return pixels, torch.randint(0, CLASSES, (BATCH, height, width), generator=generator)


class ImageBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Whole batches of images, of the sizes of :data:`SIZES` in turn (load with ``batch_size=None``)."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return images(*SIZES[index % len(SIZES)], seed=index)


def image_loader() -> DataLoader[Any]:
    return DataLoader(ImageBatches(), batch_size=None, shuffle=False)


def peak(prediction: Any) -> int:
    step = prediction.step
    assert isinstance(step, ReplayedStep), prediction.skipped
    return step.peak.peak_bytes


# ------------------------------------------------------------------------------------------------ resizing a batch


def test_an_image_and_its_mask_are_resized_alike_with_their_values_tiled() -> None:
    # 3 images of 4x4 to 6x2: two reference sizes of 4 get different new sizes; the batch dimension (3) and the
    # channels (3) keep theirs although they are equal.
    pixels = torch.arange(3 * 3 * 4 * 4).reshape(3, 3, 4, 4)
    mask = torch.arange(3 * 4 * 4).reshape(3, 4, 4) + 1000
    rows = torch.arange(3 * 4).reshape(3, 4)
    labels = torch.tensor([0, 1, 2])
    resized = resize_shape({"pixels": pixels, "mask": mask, "rows": rows, "labels": labels}, (3, 6, 2))
    assert resized["pixels"].shape == (3, 3, 6, 2) and resized["mask"].shape == (3, 6, 2)
    assert resized["rows"].shape == (3, 2)  # aligned from the end: a row of a 4-wide image
    assert torch.equal(resized["labels"], labels)
    for original, stretched in ((pixels, resized["pixels"]), (mask, resized["mask"])):
        assert torch.equal(stretched[..., :4, :], original[..., :, :2])  # cut to the width
        assert torch.equal(stretched[..., 4:, :], original[..., :2, :2])  # tiled along the height
    assert all(tensor.is_contiguous() for tensor in resized.values())


def test_a_shape_smaller_than_the_batch_cuts_it() -> None:
    pixels = torch.randn(2, 3, 8, 8)
    resized = resize_shape((pixels,), (3, 5, 8))[0]
    assert resized.shape == (2, 3, 5, 8) and torch.equal(resized, pixels[:, :, :5])


def test_max_length_is_the_shape_that_sets_every_size_of_the_length() -> None:
    tokens = torch.arange(2 * 6).reshape(2, 6)
    pairs = torch.zeros(2, 6, 6)  # every size of the length changes, as max_length always did
    features = torch.zeros(2, 6, 3)
    assert length_shape((tokens, pairs), 9) == (9,)
    assert length_shape((features,), 9) == (9, 3)
    resized = resize_length((tokens, pairs, features), 9)
    assert [tuple(tensor.shape) for tensor in resized] == [(2, 9), (2, 9, 9), (2, 9, 3)]
    assert torch.equal(resized[0], torch.cat([tokens, tokens[:, :3]], dim=1))
    with pytest.raises(ValueError, match=r"shape \(9, 9\) has 2 dimensions, the batch's \(6,\) has 1"):
        resize_shape((tokens,), (9, 9))


# --------------------------------------------------------------------------------------------------------- predict


@pytest.mark.parametrize(("height", "width"), [(96, 96), (96, 64)])
def test_predict_for_max_shape_equals_a_real_batch_of_that_shape(height: int, width: int) -> None:
    small = predict(conv_net(), images(64, 64), device_type="cpu", fit_table=False)
    resized = predict(conv_net(), images(64, 64), max_shape=(3, height, width), device_type="cpu", fit_table=False)
    real = predict(conv_net(), images(height, width), device_type="cpu", fit_table=False)
    assert peak(resized) == peak(real) > peak(small)
    assert resized.step is not None and real.step is not None
    assert resized.step.phases == real.step.phases  # every phase's peak and parts


def test_predict_resizes_an_image_and_its_mask_consistently() -> None:
    resized = predict(segmenter(), masked(32, 32), max_shape=(3, 48, 32), device_type="cpu", fit_table=False)
    real = predict(segmenter(), masked(48, 32), device_type="cpu", fit_table=False)
    swapped = predict(segmenter(), masked(32, 48), device_type="cpu", fit_table=False)
    assert peak(resized) == peak(real) == peak(swapped)  # the same pixels either way: the step ran on both
    assert resized.step is not None and real.step is not None and resized.step.phases == real.step.phases


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_shape": (3, 0, 8)}, ValueError, r"max_shape must be a tuple of ints >= 1 .*, got \(3, 0, 8\)"),
        ({"max_shape": [3, 8, 8]}, TypeError, r"max_shape must be a tuple of ints >= 1 .* or None, got \[3, 8, 8\]"),
        ({"max_shape": (8, 8)}, ValueError, r"max_shape must have a size per dimension .* \(3: \(3, 16, 16\)\)"),
        ({"max_shape": (3, 8, 8), "max_length": 8}, ValueError, "max_length and max_shape are mutually exclusive"),
    ],
)
def test_predict_checks_max_shape(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        predict(conv_net(), images(16, 16), device_type="cpu", fit_table=False, **options)


def test_predict_refuses_max_shape_for_a_batch_of_vectors() -> None:
    with pytest.raises(ValueError, match=r"max_shape needs a batch with a tensor of two or more dimensions"):
        predict(conv_net(), (torch.zeros(2), torch.zeros(2)), max_shape=(3,), device_type="cpu", fit_table=False)


# ------------------------------------------------------------------------------------------ the monitor's preflight


def small_device_run(tmp_path: Path, **options: Any) -> tuple[VramMonitor, list[str], list[int]]:
    """Train the conv net on a scripted 4 MiB CUDA device; the monitor's warnings, and how many came before step 0."""
    small = replace(SCRIPTED_DEVICE, total_bytes=4 * 1024**2)
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], device=small, free_bytes=small.total_bytes)
    monitor = VramMonitor(
        probe=probe, attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, **options
    )
    at_first_step: list[int] = []

    class Watched(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not at_first_step and not is_fake(batch[0]):
                at_first_step.append(sum(issubclass(item.category, VramMonitorWarning) for item in caught))
            return super().training_step(batch, batch_idx)

    module = conv_net()
    watched = Watched(module.network)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], max_steps=STEPS).fit(watched, image_loader())
    messages = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
    return monitor, messages, at_first_step


def test_max_shape_warns_before_step_0_when_the_largest_batch_would_not_fit(tmp_path: Path) -> None:
    monitor, messages, at_first_step = small_device_run(tmp_path, max_shape=(3, 256, 192))
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and not verdict.fits
    assert at_first_step == [1]  # warned before training_step first ran
    assert "batches of 3x256x192 per sample, the largest expected, is predicted to run out of memory" in messages[0]
    # Two 8-channel 256x192 activations of float32 alone are 3 MiB: the replay saw the resized batch.
    assert verdict.step.peak.peak_bytes > 2 * BATCH * 8 * 256 * 192 * 4
    report = monitor.report
    assert report is not None and report.shapes is not None
    assert [row.length for row in report.shapes.lengths if row.predicted] == [256]


def test_max_shape_that_fits_does_not_warn(tmp_path: Path) -> None:
    monitor, messages, at_first_step = small_device_run(tmp_path, max_shape=(3, 32, 32))
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and verdict.fits and at_first_step == [0] and messages == []
    plain, _, _ = small_device_run(tmp_path / "plain")
    assert plain.session.preflight_verdict is not None  # the first batch as it is (16x16), for comparison
    assert verdict.step.peak.peak_bytes > plain.session.preflight_verdict.step.peak.peak_bytes


def test_max_shape_with_other_dimensions_warns_once_and_checks_the_batch_as_it_is(tmp_path: Path) -> None:
    monitor, messages, at_first_step = small_device_run(tmp_path, max_shape=(256, 256))
    assert len(messages) == 1 and at_first_step == [1], messages
    assert "max_shape=(256, 256) has 2 sizes" in messages[0] and "has 3 past the batch's (3x16x16)" in messages[0]
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and verdict.fits  # the first batch, 16x16, as it is
    report = monitor.report
    assert report is not None and report.shapes is not None
    assert not any(row.predicted for row in report.shapes.lengths)


def test_max_shape_on_the_cpu_predicts_the_largest_shape_and_says_nothing_of_fitting(tmp_path: Path) -> None:
    monitor = VramMonitor(
        attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, max_shape=(3, 64, 48)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], max_steps=STEPS).fit(conv_net(), image_loader())
    assert not any("out of memory" in str(item.message) or "max_shape" in str(item.message) for item in caught)
    report = monitor.report
    assert report is not None and report.shapes is not None and monitor.session.preflight_verdict is None
    predicted = [row for row in report.shapes.lengths if row.predicted]
    assert [row.length for row in predicted] == [64]
    expected = predict(conv_net(), images(64, 48), device_type="cpu", fit_table=False)
    assert expected.step is not None
    first_pixels = images(*SIZES[0])[0]  # the first batch's images stay alive beside their resized copy
    alive = first_pixels.numel() * first_pixels.element_size()
    assert predicted[0].peak_bytes == expected.step.reported_bytes(expected.step.reported_peak) + alive
    assert predicted[0].peak_bytes > max(row.peak_bytes for row in report.shapes.lengths if not row.predicted)


def test_max_shape_reads_a_replayed_batch_of_one_size_along_its_own_dimension(tmp_path: Path) -> None:
    """Images of one size (none varies): the replayed batch's row is its height, as the predicted row is.

    A trial's U-Net (images ``(8, 3, 64, 64)``, ``max_shape=(3, 128, 128)``) printed "peak at the longest length
    expected (128): 157.5 MiB predicted; at 3 (step 2's batch, replayed): 40.2 MiB": 3 was its channels, the batch's
    dimension 1, read where no dimension varied, beside the height max_shape changes.
    """
    monitor = VramMonitor(
        attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, max_shape=(3, 32, 32)
    )
    data = DataLoader([masked(16, 16)] * STEPS, batch_size=None, shuffle=False)
    trainer(tmp_path, [monitor], max_steps=STEPS).fit(segmenter(), data)
    report = monitor.report
    assert report is not None and report.shapes is not None and not report.shapes.varies
    rows = [(row.length, row.step) for row in report.shapes.lengths]
    assert rows == [(16, 2), (32, None)], rows  # before: [(3, 2), (32, None)]
    line = longest_line(report.shapes)
    assert line is not None and "; at 16 (step 2's batch, replayed): " in line, line


def test_training_is_bit_identical_with_max_shape(tmp_path: Path) -> None:
    def build() -> Case:
        return Case(conv_net(), image_loader())

    monitor = assert_untouched(build, tmp_path, "cuda", steps=STEPS, attribution_start_step=2, max_shape=(3, 48, 48))
    assert monitor.session.preflight_verdict is not None
