"""The long tail of batch lengths: the lengths counted on the hot path, and advice to cap them, replayed and applied.

A small GPT-2-class language model trains on batches padded to their own longest sequence: 24-32 tokens (step 2's
batch, the first replayed, holds a 32-token one), and one 128-token batch at step :data:`LONG_STEP`, after enough
short ones that it is past the 95th percentile when it arrives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from advice_summaries import healthy_setup, healthy_summary
from lightning.pytorch.utilities.data import _update_dataloader
from models import trainer
from replay_models import CausalLM
from torch.utils.data import DataLoader, DistributedSampler

from lightning_vram import VramMonitor
from lightning_vram.advice.rules.long_tail import (
    CAP_LENGTH_CODE,
    STREAM_BY_TOKENS_CODE,
    STREAM_RANKS_NOTE,
    long_tail,
    long_tail_changes,
)
from lightning_vram.codec import report_from_dict
from lightning_vram.measure.batch_shapes import MAX_LENGTHS, ShapeRecorder
from lightning_vram.records import AdviceId, LengthChange, Report, TokensPerBatchChange, TrainingLoop
from lightning_vram.records.shapes import length_percentile
from lightning_vram.records.shapes_json import batch_shapes_from_dict, batch_shapes_to_dict
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict
from lightning_vram.render.text import markdown

# The long tail's advice is replayed, and applied against its replayed peak.
pytestmark = pytest.mark.replay

BATCH, LONG_STEP, LONG, STEPS, CAP = 2, 20, 128, 24, 32
VOCAB = 200


def lengths() -> list[int]:
    """Each sample's length: 24-32 tokens, 32 in step 2's batch, :data:`LONG` in step :data:`LONG_STEP`'s."""
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(24, CAP + 1, (BATCH * STEPS,), generator=generator).tolist()
    sizes[2 * BATCH] = CAP
    sizes[LONG_STEP * BATCH] = LONG
    return sizes


class Sequences(torch.utils.data.Dataset[torch.Tensor]):
    """Token sequences of the lengths of :func:`lengths` (or all :data:`CAP` long)."""

    def __init__(self, fixed: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        sizes = [CAP] * (BATCH * STEPS) if fixed else lengths()
        self.items = [torch.randint(1, VOCAB, (size,), generator=generator) for size in sizes]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def padded(cap: int | None = None) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor]]:
    """Pad each batch to its own longest sequence (token 0), then cut it to ``cap`` tokens where given."""

    def collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor]:
        batch = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
        return (batch[:, :cap] if cap is not None else batch,)

    return collate


def run(
    tmp_path: Path,
    cap: int | None = None,
    fixed: bool = False,
    loader: DataLoader[tuple[torch.Tensor]] | None = None,
    steps: int | None = None,
) -> Report:
    monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
    data = (
        DataLoader(Sequences(fixed), batch_size=BATCH, shuffle=False, collate_fn=padded(cap))
        if loader is None
        else loader
    )
    torch.manual_seed(0)
    trainer(tmp_path, [monitor], max_steps=steps or len(data)).fit(CausalLM(layers=1, vocab=VOCAB), data)
    assert monitor.report is not None
    return monitor.report


def test_lengths_are_counted_per_batch_and_bounded() -> None:
    shapes = ShapeRecorder()
    for step, length in enumerate([16, 16, 16, 40, 16]):
        shapes.observe(step, (torch.zeros(2, length), torch.zeros(2)))
    assert shapes.length_counts == {16: 4, 40: 1}
    for step in range(MAX_LENGTHS + 10):
        shapes.observe(step, (torch.zeros(1, step + 100),))
    assert len(shapes.length_counts) == MAX_LENGTHS  # new lengths past the bound are not counted
    record = shapes.record()
    assert record is not None and record.length_counts[:2] == ((16, 4), (40, 1))
    assert length_percentile(((16, 19), (128, 1)), 0.95) == 16
    assert length_percentile(((16, 18), (128, 2)), 0.95) == 128
    assert length_percentile((), 0.95) is None


def test_the_long_tail_is_capped_in_the_replay_and_the_cap_applied_holds_the_predicted_peak(tmp_path: Path) -> None:
    report = run(tmp_path / "tail")
    assert report.shapes is not None and report.shapes.replayed_step == LONG_STEP
    counts = dict(report.shapes.length_counts)
    assert sum(counts.values()) == STEPS and counts[LONG] == 1 and max(counts) == LONG
    simulation = report.simulation
    assert simulation is not None and simulation.skipped is None and simulation.baseline is not None
    variant = next(variant for variant in simulation.variants if isinstance(variant.change, LengthChange))
    assert variant.change == LengthChange(CAP) and variant.replayed is not None
    advice = next(advice for advice in report.advice if advice.id is AdviceId.LONG_TAIL)
    baseline = simulation.baseline.reported_bytes(simulation.baseline.reported_peak)
    predicted = variant.replayed.reported_bytes(variant.replayed.reported_peak)
    assert advice.saving_basis == "simulated" and advice.estimated_saving_bytes == baseline - predicted > 0
    assert advice.predicted_peak_bytes == predicted
    assert f"max_length={CAP}, truncation=True" in advice.detail
    assert f"batch = cap_length(batch, {CAP})" in advice.detail
    assert f"the longest {LONG}" in advice.evidence and "sequences capped at 32 tokens" in advice.evidence
    assert "Bucketing by length alone" in advice.detail  # answered, not offered: the longest bucket keeps the shape
    assert "the tokens past the cap are no longer trained on: another model" in advice.detail  # not memory only

    # Applied as printed: the same data cut to the cap. The peak measured is the one predicted, the advice gone.
    applied = run(tmp_path / "capped", cap=CAP)
    assert applied.peak is not None and applied.shapes is not None and max(dict(applied.shapes.length_counts)) == CAP
    assert abs(applied.peak.peak_bytes - predicted) <= 0.10 * predicted, (applied.peak.peak_bytes, predicted)
    assert report.peak is not None and report.peak.peak_bytes - applied.peak.peak_bytes >= 0.05 * report.peak.peak_bytes
    assert AdviceId.LONG_TAIL not in {advice.id for advice in applied.advice}
    assert applied.simulation is not None
    assert not any(isinstance(variant.change, LengthChange) for variant in applied.simulation.variants)

    text = markdown(report)
    assert f"95% of the batches had length at most {CAP} (the largest {LONG})" in text
    assert "sequences capped at 32 tokens" in text  # the variant, rendered

    # The counts and the replayed cap survive the JSON both ways; a report from before the counts still reads.
    assert report_from_dict(json.loads(json.dumps(report.to_dict()))).shapes == report.shapes
    read = simulation_from_dict(json.loads(json.dumps(simulation_to_dict(simulation))))
    assert read is not None and LengthChange(CAP) in [variant.change for variant in read.variants]
    old = batch_shapes_to_dict(report.shapes)
    assert old is not None
    del old["length_counts"]
    before = batch_shapes_from_dict(old, "report.shapes")
    assert before is not None and before.length_counts == () and before.lengths == report.shapes.lengths


def test_silent_on_batches_of_one_length(tmp_path: Path) -> None:
    report = run(tmp_path, fixed=True)
    assert report.shapes is not None and report.shapes.length_counts == ((CAP, STEPS),)
    assert AdviceId.LONG_TAIL not in {advice.id for advice in report.advice}
    assert report.simulation is not None
    assert not any(isinstance(variant.change, LengthChange) for variant in report.simulation.variants)


def test_a_tail_too_short_or_too_common_declares_nothing() -> None:
    summary, setup = healthy_summary(), healthy_setup()
    assert long_tail_changes(summary, setup) == ()
    tail = replace(summary, length_counts=((32, 19), (128, 1)))
    assert long_tail_changes(tail, setup) == (LengthChange(32), TokensPerBatchChange(32 * summary.batch_size))
    assert long_tail_changes(replace(tail, batch_size=1), setup) == (LengthChange(32),)  # one sequence a batch
    assert long_tail_changes(replace(summary, length_counts=((32, 19), (40, 1))), setup) == ()  # under 1.5x
    assert long_tail_changes(replace(summary, length_counts=((32, 18), (128, 2))), setup) == ()  # not a tail: 10%


def printed_code(detail: str, name: str) -> str:
    """The code block of an advice's detail that defines ``name``."""
    blocks = [block.split("```", 1)[0] for block in detail.split("```python\n")[1:]]
    return next(block for block in blocks if f"def {name}(" in block)


def test_batching_by_tokens_is_replayed_and_the_printed_sampler_applied_holds_the_predicted_peak(
    tmp_path: Path,
) -> None:
    report = run(tmp_path / "tail")
    simulation = report.simulation
    assert simulation is not None and simulation.baseline is not None
    tokens = TokensPerBatchChange(BATCH * CAP)
    variant = next(variant for variant in simulation.variants if variant.change == tokens)
    assert variant.replayed is not None and variant.replayed.batch_size == 1  # the 128-token batch holds one
    predicted = variant.replayed.reported_bytes(variant.replayed.reported_peak)
    advice = next(advice for advice in report.advice if advice.id is AdviceId.LONG_TAIL)
    assert "batches of at most 64 tokens" in advice.evidence and "max_tokens=64" in advice.detail
    assert "their order and the steps an epoch has change: another model" in advice.detail  # not memory only
    read = simulation_from_dict(json.loads(json.dumps(simulation_to_dict(simulation))))
    assert read is not None and tokens in [variant.change for variant in read.variants]

    # Applied as printed: the advice's own sampler over the run's lengths. The long batch holds one sequence; the
    # peak measured is the one predicted, and batching by tokens is no longer offered.
    namespace: dict[str, object] = {
        "DataLoader": DataLoader,
        "dataset": Sequences(),
        "lengths": lengths(),
        "collate": padded(),
    }
    exec(printed_code(advice.detail, "batches_by_tokens"), namespace)  # the advice's code, run as printed
    loader = namespace["loader"]
    assert isinstance(loader, DataLoader)
    assert [len(batch) for batch in loader.batch_sampler if lengths()[batch[-1]] == LONG] == [1]  # type: ignore[union-attr]
    applied = run(tmp_path / "by-tokens", loader=loader)
    assert applied.peak is not None and report.peak is not None
    assert abs(applied.peak.peak_bytes - predicted) <= 0.10 * predicted, (applied.peak.peak_bytes, predicted)
    assert report.peak.peak_bytes - applied.peak.peak_bytes >= 0.05 * report.peak.peak_bytes
    assert all("batch by tokens" not in advice.detail.lower() for advice in applied.advice)

    # What is still offered, capping the one long sequence, counts its saving only down to the batches within the
    # cap (replayed at step 2), which stay: capping as well realises it within 10%.
    cap = next(advice for advice in applied.advice if advice.id is AdviceId.LONG_TAIL)
    assert "which stays: the saving is counted to there" in cap.evidence and cap.estimated_saving_bytes is not None
    capped = run(tmp_path / "capped", cap=CAP)
    assert capped.peak is not None
    realised = applied.peak.peak_bytes - capped.peak.peak_bytes
    assert abs(cap.estimated_saving_bytes - realised) <= 0.10 * realised, (cap.estimated_saving_bytes, realised)


class SequenceClassifier(pl.LightningModule):
    """A transformer encoder layer over token embeddings, mean-pooled under the mask: a label per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 64)
        self.encoder = torch.nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(64, 3)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        mask = batch["attention_mask"]
        hidden = self.encoder(self.embedding(batch["input_ids"]), src_key_padding_mask=mask == 0)
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return torch.nn.functional.cross_entropy(self.head(pooled), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def labelled(cut: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Callable[..., Any]:
    """Pad each batch to its own longest sequence, as a dict with its mask and a label (B,) per sequence; ``cut``
    applied to it where given."""

    def collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
        batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": ids[:, 0] % 3}
        return cut(batch) if cut is not None else batch

    return collate


def test_the_printed_cap_cuts_a_labelled_dict_batch_and_realises_the_saving(tmp_path: Path) -> None:
    # A sequence classifier's batch holds a label per sequence, shape (B,): the printed cut must leave it whole.
    # Before: `{key: value[:, :32] for key, value in batch.items()}` raised IndexError on the labels.
    def fitted(root: Path, collate: Callable[..., Any]) -> Report:
        monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
        data = DataLoader(Sequences(), batch_size=BATCH, shuffle=False, collate_fn=collate)
        torch.manual_seed(0)
        trainer(root, [monitor], max_steps=len(data)).fit(SequenceClassifier(), data)
        assert monitor.report is not None
        return monitor.report

    report = fitted(tmp_path / "tail", labelled())
    advice = next(advice for advice in report.advice if advice.id is AdviceId.LONG_TAIL)
    assert advice.predicted_peak_bytes is not None and report.peak is not None
    padded_batch = labelled()([torch.arange(1, LONG + 1), torch.arange(1, 25)])
    namespace: dict[str, Any] = {"torch": torch, "tokenizer": lambda *_, **__: None, "texts": [], "batch": padded_batch}
    exec(printed_code(advice.detail, "cap_length"), namespace)  # the advice's code, run as printed
    cut = namespace["batch"]
    assert {key: tuple(value.shape) for key, value in cut.items()} == {
        "input_ids": (BATCH, CAP),
        "attention_mask": (BATCH, CAP),
        "labels": (BATCH,),
    }
    applied = fitted(tmp_path / "capped", labelled(lambda batch: namespace["cap_length"](batch, CAP)))
    assert applied.peak is not None and applied.shapes is not None and max(dict(applied.shapes.length_counts)) == CAP
    predicted = advice.predicted_peak_bytes
    assert abs(applied.peak.peak_bytes - predicted) <= 0.10 * predicted, (applied.peak.peak_bytes, predicted)
    assert AdviceId.LONG_TAIL not in {advice.id for advice in applied.advice}


class LastStateClassifier(pl.LightningModule):
    """An LSTM over padded sequences, classifying from each sequence's last real step: read at ``lengths - 1``."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 64)
        self.lstm = torch.nn.LSTM(64, 128, batch_first=True)
        self.head = torch.nn.Linear(128, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, lengths, labels = batch
        output, _ = self.lstm(self.embedding(ids))
        last = output[torch.arange(ids.shape[0]), lengths - 1]
        return torch.nn.functional.cross_entropy(self.head(last), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


def test_the_printed_cap_clamps_a_tensor_of_lengths_it_is_told_of(tmp_path: Path) -> None:
    # The replay of the cut batch indexes the LSTM's output at lengths - 1 = 127 of 32 (fake tensors check no index)
    # and advises the cap; applied, a length past the cap must be clamped or training raises IndexError.
    def fitted(root: Path, cut: Callable[[Any], Any] | None = None) -> Report:
        def collate(samples: list[torch.Tensor]) -> Any:
            ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
            batch = (ids, torch.tensor([len(sample) for sample in samples]), ids[:, 0] % 3)
            return cut(batch) if cut is not None else batch

        monitor = VramMonitor(attribution_start_step=2, attribution_every_n_steps=None, console_summary=False)
        data = DataLoader(Sequences(), batch_size=BATCH, shuffle=False, collate_fn=collate)
        torch.manual_seed(0)
        trainer(root, [monitor], max_steps=len(data)).fit(LastStateClassifier(), data)
        assert monitor.report is not None
        return monitor.report

    report = fitted(tmp_path / "tail")
    advice = next(advice for advice in report.advice if advice.id is AdviceId.LONG_TAIL)
    assert advice.predicted_peak_bytes is not None
    assert "a tensor of each sequence's length in the batch must be clamped to the cap too" in advice.detail
    assert f"cap_length(batch, {CAP}, lengths=1), its index or key" in advice.detail
    namespace: dict[str, Any] = {"torch": torch}
    exec(printed_code(advice.detail, "cap_length").split("\nbatch = cap_length(")[0].split("\n", 1)[1], namespace)
    cap_length = namespace["cap_length"]
    with pytest.raises(IndexError):  # the lengths left as they are: what the step reads is past the cut
        fitted(tmp_path / "unclamped", lambda batch: cap_length(batch, CAP))
    applied = fitted(tmp_path / "capped", lambda batch: cap_length(batch, CAP, lengths=1))
    assert applied.peak is not None and applied.shapes is not None and max(dict(applied.shapes.length_counts)) == CAP
    predicted = advice.predicted_peak_bytes
    assert abs(applied.peak.peak_bytes - predicted) <= 0.10 * predicted, (applied.peak.peak_bytes, predicted)
    assert AdviceId.LONG_TAIL not in {advice.id for advice in applied.advice}


def test_batching_by_tokens_on_several_ranks_prints_each_rank_an_equal_share(tmp_path: Path) -> None:
    # A list of batches is no BatchSampler: on 2 ranks Lightning's Trainer puts its DistributedSampler into the
    # training loader (`_update_dataloader`, as fit does) and raised TypeError on the single-process loader printed.
    report = run(tmp_path)
    one = long_tail(report.summary, healthy_setup(), report.simulation)
    assert one is not None
    namespace: dict[str, Any] = {"DataLoader": DataLoader, "dataset": Sequences(), "lengths": lengths()}
    single = printed_code(one.detail, "batches_by_tokens")
    exec(single, namespace | {"collate": padded()}, scope := {})
    with pytest.raises(TypeError, match="can't inject a \\(distributed\\) sampler"):
        _update_dataloader(scope["loader"], DistributedSampler(Sequences(), num_replicas=2, rank=0))

    for loop, told in (
        (TrainingLoop.LIGHTNING, "Trainer(..., use_distributed_sampler=False)"),
        (TrainingLoop.FABRIC, "fabric.setup_dataloaders(loader, use_distributed_sampler=False)"),
        (TrainingLoop.PLAIN, "torch.distributed.get_rank()"),
    ):
        advice = long_tail(report.summary, healthy_setup(world_size=2, loop=loop), report.simulation)
        assert advice is not None
        code = printed_code(advice.detail, "batches_by_tokens")
        assert told in code
        shares = []
        for rank in (0, 1):
            exec(code, {**namespace, "collate": padded(), "rank": rank, "world_size": 2}, scope := {})
            shares.append([list(batch) for batch in scope["loader"].batch_sampler])
        every = {index for share in shares for batch in share for index in batch}
        assert len(shares[0]) == len(shares[1]) > 0  # the ranks step together
        assert every == set(range(len(lengths())))  # every sequence trained on, the longest (last) one included
        assert sum(len(share) for share in shares) - len(set(map(tuple, shares[0] + shares[1]))) <= 1  # one repeated


class SequenceStream(torch.utils.data.IterableDataset[torch.Tensor]):
    """:class:`Sequences`' samples read one after another, as a stream of records is."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from Sequences().items


def test_batching_by_tokens_over_a_stream_is_printed_for_a_stream(tmp_path: Path) -> None:
    # A DataLoader takes no batch sampler over an IterableDataset: the printed `batch_sampler=` raised ValueError.
    stream = DataLoader(SequenceStream(), batch_size=BATCH, collate_fn=padded())
    report = run(tmp_path / "tail", loader=stream, steps=STEPS)
    advice = next(advice for advice in report.advice if advice.id is AdviceId.LONG_TAIL)
    assert advice.predicted_peak_bytes is not None and report.peak is not None
    with pytest.raises(ValueError, match="expected unspecified batch_sampler option"):
        DataLoader(SequenceStream(), batch_sampler=[[0, 1]])  # what the map-style code printed asks for
    assert "batch_sampler" not in advice.detail
    assert "a DataLoader takes no batch sampler over an IterableDataset" in advice.detail
    tokens = next(variant for variant in report.simulation.variants if isinstance(variant.change, TokensPerBatchChange))  # type: ignore[union-attr]
    assert tokens.replayed is not None
    predicted = tokens.replayed.reported_bytes(tokens.replayed.reported_peak)
    namespace: dict[str, Any] = {
        "torch": torch,
        "DataLoader": DataLoader,
        "dataset": SequenceStream(),
        "collate": padded(),
    }
    exec(printed_code(advice.detail, "__init__"), namespace)  # the advice's code, run as printed
    loader = namespace["loader"]
    batches = [batch for (batch,) in loader]
    assert sum(len(batch) for batch in batches) == BATCH * STEPS  # every sequence, once, none cut
    assert all(batch.numel() <= BATCH * CAP or len(batch) == 1 for batch in batches)
    applied = run(tmp_path / "by-tokens", loader=loader, steps=len(batches))
    assert applied.peak is not None
    assert abs(applied.peak.peak_bytes - predicted) <= 0.10 * predicted, (applied.peak.peak_bytes, predicted)


def test_batching_by_tokens_over_a_stream_on_several_ranks_is_not_offered(tmp_path: Path) -> None:
    # Each rank's stream of batches by tokens holds as many batches as its own sequences' lengths make, and a stream
    # cannot be counted beforehand to even them: before, the stream code was printed on 2 ranks as on one, and the
    # ranks' shares of this stream, split by rank, gave the printed BatchesByTokens 13 and 12 batches (DDP: a hang).
    report = run(tmp_path)
    namespace: dict[str, Any] = {"torch": torch}
    exec(STREAM_BY_TOKENS_CODE, namespace)
    shares = [Sequences().items[rank::2] for rank in (0, 1)]
    counts = [sum(1 for _ in namespace["BatchesByTokens"](share, max_tokens=BATCH * CAP)) for share in shares]
    assert counts == [13, 12]  # equal shares (24 sequences each), unequal batches: the ranks would not step together
    one = long_tail(report.summary, replace(healthy_setup(), iterable_dataset=True), report.simulation)
    assert one is not None and "class BatchesByTokens" in one.detail  # one rank: the stream's code, as before
    advice = long_tail(report.summary, replace(healthy_setup(world_size=2), iterable_dataset=True), report.simulation)
    assert advice is not None  # the cap is still offered
    assert "class BatchesByTokens" not in advice.detail and "batch_sampler" not in advice.detail  # before: printed
    assert STREAM_RANKS_NOTE in advice.detail
    assert f"batch = cap_length(batch, {CAP})" in advice.detail


def _printed_cap_length() -> Callable[..., Any]:
    """The advice's `cap_length`, run as printed (the detail holds CAP_LENGTH_CODE verbatim)."""
    namespace: dict[str, Any] = {"torch": torch}
    exec(CAP_LENGTH_CODE, namespace)
    return namespace["cap_length"]  # type: ignore[no-any-return]


def _padded(lengths: list[int], left: bool) -> dict[str, torch.Tensor]:
    """A tokenizer's dict batch of ``lengths`` tokens, padded (0) on the left (Llama's tokenizers) or the right."""
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        place = slice(longest - length, longest) if left else slice(0, length)
        ids[row, place] = torch.arange(1, length + 1)
        mask[row, place] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_the_printed_cap_keeps_every_sequence_of_a_padded_batch_either_side(left: bool) -> None:
    """Cut at the right, a left-padded batch (LlamaTokenizerFast's default) kept only its long sequence's tokens:
    before, 64, 0, 0 and 0 tokens of sequences of 300, 40, 20 and 12 (the short ones all padding)."""
    lengths = [300, 40, 20, 12]
    batch = _padded(lengths, left)
    cut = _printed_cap_length()(batch, 64)
    assert cut["input_ids"].shape == (4, 64)  # the shape the replay cut: its saving holds
    assert cut["attention_mask"].sum(1).tolist() == [64, 40, 20, 12]  # before (left): [64, 0, 0, 0]
    kept = cut["input_ids"][cut["attention_mask"].bool()].split([64, 40, 20, 12])
    whole = batch["input_ids"][batch["attention_mask"].bool()].split(lengths)
    for row, (tokens, sequence) in enumerate(zip(kept, whole, strict=True)):
        assert torch.equal(tokens, sequence[-64:] if left else sequence[:64]), row  # a left-padded one: its last 64
    assert torch.equal(cut["labels"], cut["input_ids"].masked_fill(cut["attention_mask"] == 0, -100))


class Sample(NamedTuple):
    ids: torch.Tensor
    lengths: torch.Tensor
    label: torch.Tensor


def test_the_printed_cap_cuts_a_namedtuple_batch() -> None:
    # default_collate keeps a namedtuple sample's type; before: "TypeError: Sample.__new__() missing 2 required
    # positional arguments: 'lengths' and 'label'" from the printed code.
    samples = [
        Sample(torch.arange(1, 101), torch.tensor(100), torch.tensor(1)),
        Sample(torch.ones(100), torch.tensor(7), torch.tensor(0)),
    ]
    batch = torch.utils.data.default_collate(samples)
    assert isinstance(batch, Sample)
    cut = _printed_cap_length()(batch, 32, lengths=1)
    assert isinstance(cut, Sample)
    assert cut.ids.shape == (2, 32) and torch.equal(cut.ids[0], torch.arange(1, 33))
    assert cut.lengths.tolist() == [32, 7] and torch.equal(cut.label, batch.label)
