"""Variable-length batches: the shapes a run sees, the worst batch replayed when it arrives, and the longest length
the user expects checked before step 0.

A small GPT-2-class language model trains on batches padded to their own longest sequence: mostly 16-32 tokens,
one 128-token batch at step :data:`LONG_STEP`.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile.harness import Case, assert_untouched
from models import TEST_REPLAY_BUDGET_SECONDS, trainer
from replay_models import CausalLM
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader

from lightning_vram import VramMonitor, VramMonitorWarning
from lightning_vram.codec import report_from_dict
from lightning_vram.measure.batch_shapes import ShapeRecorder
from lightning_vram.measure.setup import longest_sample
from lightning_vram.predict import predict
from lightning_vram.records import BatchShapes, LengthPeak, TensorShapes
from lightning_vram.records.json_reader import FormatError
from lightning_vram.records.shapes_json import batch_shapes_from_dict, batch_shapes_to_dict
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown, summary_text
from lightning_vram.testing import SCRIPTED_DEVICE, ScriptedBoundary, ScriptedProbe
from lightning_vram.units import format_bytes

# Lengths replayed as they arrive, and the largest expected.
pytestmark = pytest.mark.replay

BATCH, LONG_STEP, LONG, STEPS = 2, 6, 128, 8
VOCAB = 200


def lengths() -> list[int]:
    """Each sample's length: 16-32 tokens, and one of :data:`LONG` in the batch of step :data:`LONG_STEP`."""
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(16, 33, (BATCH * (STEPS + 2),), generator=generator).tolist()
    sizes[LONG_STEP * BATCH] = LONG
    return sizes


class Sequences(torch.utils.data.Dataset[torch.Tensor]):
    """Token sequences of the lengths of :func:`lengths`."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, VOCAB, (size,), generator=generator) for size in lengths()]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor]:
    """Pad each batch to its own longest sequence (token 0)."""
    return (torch.nn.utils.rnn.pad_sequence(samples, batch_first=True),)


def variable_loader() -> DataLoader[Any]:
    return DataLoader(Sequences(), batch_size=BATCH, shuffle=False, collate_fn=pad)


def model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(layers=1, vocab=VOCAB)


def test_shapes_are_recorded_per_dimension() -> None:
    shapes = ShapeRecorder()
    steps = [torch.zeros(2, 20), torch.zeros(2, 16), torch.zeros(2, 40), torch.zeros(1, 30)]
    grew = [shapes.observe(step, ({"input_ids": batch, "labels": batch},)) for step, batch in enumerate(steps)]
    assert grew == [True, False, True, False]
    record = shapes.record()
    assert record is not None and record.largest_step == 2 and record.largest_elements == 160
    assert [(t.name, t.smallest, t.largest, t.varying) for t in record.tensors] == [
        ("batch[0]['input_ids']", (1, 16), (2, 40), (0, 1)),
        ("batch[0]['labels']", (1, 16), (2, 40), (0, 1)),
    ]
    assert shapes.length_of(({"input_ids": steps[3], "labels": steps[3]},)) == 30


def test_a_mistyped_shapes_field_is_named_when_read_back() -> None:
    shapes = BatchShapes((TensorShapes("batch[0]", (2, 16), (2, 128)),), 6, 256, 6, (LengthPeak(128, 5 * 2**20, 6),))
    data = batch_shapes_to_dict(shapes)
    assert batch_shapes_from_dict(json.loads(json.dumps(data)), "report.shapes") == shapes
    assert batch_shapes_from_dict(None, "report.shapes") is None
    assert data is not None
    data["tensors"][0]["smallest"] = [2, "16"]
    with pytest.raises(FormatError, match=re.escape("report.shapes.tensors[0].smallest[1] must be an integer")):
        batch_shapes_from_dict(data, "report.shapes")
    data["tensors"][0]["smallest"] = [2]
    with pytest.raises(FormatError, match="as many dimensions"):
        batch_shapes_from_dict(data, "report.shapes")


def test_the_longest_batch_is_replayed_at_its_step_and_the_advice_refers_to_it(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    trainer(tmp_path, [monitor], max_steps=STEPS).fit(model(), variable_loader())
    report = monitor.report
    assert report is not None and report.shapes is not None and report.peak is not None
    shapes = report.shapes
    assert shapes.largest_step == LONG_STEP and shapes.replayed_step == LONG_STEP
    assert [tensor.largest[1] for tensor in shapes.tensors] == [LONG]
    # The long step was counted too: the report's peak is its step, and the advice comes from its replay.
    assert report.peak.step == LONG_STEP
    assert report.simulation is not None and report.simulation.match is not None
    assert report.simulation.match.step == LONG_STEP and report.simulation.skipped is None
    long = [row for row in shapes.lengths if row.step == LONG_STEP]
    assert len(long) == 1 and long[0].length == LONG
    assert abs(long[0].peak_bytes - report.peak.peak_bytes) <= 0.05 * report.peak.peak_bytes
    assert shapes.lengths[0].length < LONG and shapes.lengths[0].step == 2  # the first replay, shorter
    # The per-length table survives the JSON both ways and is rendered.
    assert report_from_dict(report.to_dict()).shapes == shapes
    text = markdown(report)
    assert "## Batch shapes" in text and f"step {LONG_STEP}" in text and f"| {LONG} |" in text


TRAINED: list[CausalLM] = []
"""The model being trained, as a script's global would hold it."""


class ReachesTheModel(CausalLM):
    """A step that reads the global holding the trained model: the replay refuses it (it would touch the model)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert TRAINED
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("budget", [0.0, None])
def test_the_longest_batch_is_counted_where_the_replay_does_not_run(tmp_path: Path, budget: float | None) -> None:
    """Replays off (a zero budget), or a step the replay refuses (it reaches a global model): the long step is still
    counted, the report's peak is its step, and the report does not say the advice came from a replay."""
    monitor = VramMonitor(
        attribution_start_step=2,
        attribution_every_n_steps=None,
        console_summary=False,
        replay_budget_seconds=TEST_REPLAY_BUDGET_SECONDS if budget is None else budget,
    )
    torch.manual_seed(0)
    module = CausalLM(layers=1, vocab=VOCAB) if budget is not None else ReachesTheModel(layers=1, vocab=VOCAB)
    TRAINED.append(module)
    trainer(tmp_path, [monitor], max_steps=STEPS).fit(module, variable_loader())
    TRAINED.clear()
    report = monitor.report
    assert report is not None and report.shapes is not None and report.peak is not None
    assert report.peak.step == LONG_STEP
    if budget is None:
        assert report.simulation is not None and "reaches the trained model" in (report.simulation.skipped or "")
    assert report.shapes.replayed_step is None
    assert "come from the replay" not in markdown(report)


@pytest.mark.parametrize(("path", "max_length"), [("cpu", None), ("cuda", None), ("cpu", LONG)])
def test_training_is_bit_identical_with_the_monitor_on_variable_lengths(
    tmp_path: Path, path: str, max_length: int | None
) -> None:
    def build() -> Case:
        return Case(model(), variable_loader())

    monitor = assert_untouched(build, tmp_path, path, steps=STEPS, attribution_start_step=2, max_length=max_length)
    shapes = monitor.report.shapes if monitor.report is not None else None
    assert shapes is not None and shapes.replayed_step == LONG_STEP


def small_device_run(
    tmp_path: Path, data: DataLoader[Any] | None = None, **options: Any
) -> tuple[VramMonitor, list[str], list[int]]:
    """Train on a scripted 4 MiB CUDA device; the monitor's warnings, and how many existed at the first real step."""
    small = replace(SCRIPTED_DEVICE, total_bytes=4 * 1024**2)
    probe = ScriptedProbe([ScriptedBoundary(0, 0, 0)], device=small, free_bytes=small.total_bytes)
    monitor = VramMonitor(
        probe=probe, attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, **options
    )
    at_first_step: list[int] = []

    class Watched(CausalLM):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not at_first_step and not is_fake(batch[0]):
                at_first_step.append(sum(issubclass(item.category, VramMonitorWarning) for item in caught))
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], max_steps=STEPS).fit(Watched(layers=1, vocab=VOCAB), data or variable_loader())
    messages = [str(item.message) for item in caught if issubclass(item.category, VramMonitorWarning)]
    return monitor, messages, at_first_step


def test_max_length_warns_before_step_0_when_the_longest_batch_would_not_fit(tmp_path: Path) -> None:
    monitor, messages, at_first_step = small_device_run(tmp_path, max_length=LONG)
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and not verdict.fits
    assert at_first_step == [1]  # warned before training_step first ran
    assert f"batches {LONG} long, the longest expected, is predicted to run out of memory" in messages[0]
    report = monitor.report
    assert report is not None and report.shapes is not None
    predicted = [row for row in report.shapes.lengths if row.predicted]
    seen = [row for row in report.shapes.lengths if row.step == LONG_STEP]
    assert [row.length for row in predicted] == [LONG] and len(seen) == 1
    # The prediction before step 0 agrees with the replay of the long batch when it came (within 5%).
    assert abs(predicted[0].peak_bytes - seen[0].peak_bytes) <= 0.05 * seen[0].peak_bytes


def test_a_length_grouped_sampler_tells_the_longest_length_before_step_0(tmp_path: Path) -> None:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    sampler = LengthGroupedSampler(BATCH, lengths=lengths())
    data = DataLoader(Sequences(), batch_size=BATCH, sampler=sampler, collate_fn=pad)
    monitor, messages, at_first_step = small_device_run(tmp_path, data)
    assert at_first_step == [1] and f"batches {LONG} long, the longest expected" in messages[0]
    report = monitor.report
    assert report is not None and report.shapes is not None
    assert [row.length for row in report.shapes.lengths if row.predicted] == [LONG]


class PadTo:
    """A collator as transformers' keep theirs: ``max_length`` and ``padding`` attributes, each batch padded to it."""

    def __init__(self, max_length: int) -> None:
        self.max_length, self.padding = max_length, "max_length"

    def __call__(self, samples: list[torch.Tensor]) -> tuple[torch.Tensor]:
        padded = torch.zeros(len(samples), self.max_length, dtype=samples[0].dtype)
        for row, sample in zip(padded, samples, strict=True):
            row[: len(sample)] = sample
        return (padded,)


class Computed:
    """Its ``max_length`` is computed by a property: reading it would run the collator's own code."""

    padding = "max_length"

    @property
    def max_length(self) -> int:
        raise AssertionError("the monitor ran the collator's code")


def tokenizer() -> Any:
    """A transformers tokenizer built in memory (two words, no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"[PAD]": 0, "a": 1}, unk_token="[PAD]"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]")


def test_a_transformers_collator_padding_to_max_length_tells_the_longest_length() -> None:
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding
    from transformers.utils import PaddingStrategy

    def loader(collator: Any, sampler: Any = None) -> DataLoader[Any]:
        return DataLoader(Sequences(), batch_size=BATCH, sampler=sampler, collate_fn=collator)

    padding = DataCollatorWithPadding(tokenizer(), padding="max_length", max_length=LONG)
    assert padding([{"input_ids": [1, 1]}, {"input_ids": [1]}])["input_ids"].shape == (2, LONG)
    assert longest_sample(loader(padding)) == LONG
    enum = DataCollatorForSeq2Seq(tokenizer(), padding=PaddingStrategy.MAX_LENGTH, max_length=LONG)
    assert longest_sample(loader(enum)) == LONG
    # Padded to each batch's longest, or without a length: the collator tells nothing.
    assert longest_sample(loader(DataCollatorWithPadding(tokenizer(), padding=True, max_length=LONG))) is None
    assert longest_sample(loader(DataCollatorWithPadding(tokenizer(), padding="max_length"))) is None
    assert longest_sample(loader(Computed())) is None and longest_sample(loader(pad)) is None
    # With a sampler listing every length: the longer of the two.
    from transformers.trainer_pt_utils import LengthGroupedSampler

    sampler = LengthGroupedSampler(BATCH, lengths=lengths())
    assert longest_sample(loader(PadTo(2 * LONG), sampler)) == 2 * LONG
    assert longest_sample(loader(PadTo(16), sampler)) == LONG


def test_a_collator_padding_to_max_length_tells_the_longest_length_before_step_0(tmp_path: Path) -> None:
    data = DataLoader(Sequences(), batch_size=BATCH, collate_fn=PadTo(LONG))
    monitor, messages, at_first_step = small_device_run(tmp_path, data)
    assert at_first_step == [1] and f"batches {LONG} long, the longest expected" in messages[0]
    report = monitor.report
    assert report is not None and report.shapes is not None
    assert [row.length for row in report.shapes.lengths if row.predicted] == [LONG]


def test_the_first_batch_fits_without_max_length(tmp_path: Path) -> None:
    monitor, messages, at_first_step = small_device_run(tmp_path)
    verdict = monitor.session.preflight_verdict
    assert verdict is not None and verdict.fits and at_first_step == [0]
    assert any(f"step {LONG_STEP}'s batch ({LONG} long)" in message for message in messages), messages


def test_max_length_on_the_cpu_predicts_the_longest_length_and_says_nothing_of_fitting(tmp_path: Path) -> None:
    monitor = VramMonitor(
        attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, max_length=512
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], max_steps=4).fit(model(), variable_loader())
    assert not any("out of memory" in str(item.message) for item in caught)
    report = monitor.report
    assert report is not None and report.shapes is not None and monitor.session.preflight_verdict is None
    rows = report.shapes.lengths
    assert rows[-1].length == 512 and rows[-1].predicted
    assert rows[-1].peak_bytes > max(row.peak_bytes for row in rows[:-1])
    assert "| 512 | " in markdown(report) and "predicted (the longest expected)" in markdown(report)


def pad_to_32(samples: list[torch.Tensor]) -> tuple[torch.Tensor]:
    """Pad (or cut) every sequence to 32 tokens: batches all of one shape, as a tokenizer padding to a fixed length."""
    return (torch.stack([torch.nn.functional.pad(sample[:32], (0, 32 - len(sample[:32]))) for sample in samples]),)


def test_max_length_on_the_cpu_with_batches_of_one_shape_reports_the_predicted_peak(tmp_path: Path) -> None:
    # A trial's BERT, padded to 128 with max_length=512 on the CPU: the JSON had the peak predicted at 512, but the
    # console, the Markdown and the HTML showed the batch shapes only where they varied, so never said it.
    monitor = VramMonitor(
        attribution_start_step=2, attribution_every_n_steps=None, console_summary=False, max_length=512
    )
    loader = DataLoader(Sequences(), batch_size=BATCH, shuffle=False, collate_fn=pad_to_32)
    trainer(tmp_path, [monitor], max_steps=4).fit(model(), loader)
    report = monitor.report
    assert report is not None and report.shapes is not None and not report.shapes.varies
    seen, longest = report.shapes.lengths
    assert (seen.length, seen.step, longest.length, longest.predicted) == (32, 2, 512, True)
    text = markdown(report)
    assert "## Batch shapes" in text
    assert f"| 512 | {format_bytes(longest.peak_bytes)} | predicted (the longest expected) |" in text
    assert f"| 32 | {format_bytes(seen.peak_bytes)} | step 2 |" in text
    page = render_html(report)
    assert "<h2>Batch shapes</h2>" in page
    assert f'<td class="n">512</td><td class="n">{format_bytes(longest.peak_bytes)}</td>' in page
    summary = " ".join(summary_text(report, width=1000).split())
    assert (
        f"peak at the longest length expected (512): {format_bytes(longest.peak_bytes)} predicted;"
        f" at 32 (step 2's batch, replayed): {format_bytes(seen.peak_bytes)}"
    ) in summary


def test_predict_takes_the_longest_length() -> None:
    batch = (torch.randint(1, VOCAB, (BATCH, 16)),)
    short = predict(model(), batch, device_type="cpu", fit_table=False)
    long = predict(model(), batch, device_type="cpu", fit_table=False, max_length=LONG)
    resized = predict(model(), (torch.randint(1, VOCAB, (BATCH, LONG)),), device_type="cpu", fit_table=False)
    assert short.step is not None and long.step is not None and resized.step is not None
    assert long.step.peak.peak_bytes == resized.step.peak.peak_bytes > short.step.peak.peak_bytes


@pytest.mark.parametrize("value", [0, -3, 2.5, "128", True])
def test_max_length_is_checked(value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="max_length"):
        VramMonitor(max_length=value)
