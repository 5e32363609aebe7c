"""Long tail of batch lengths: a few batches far longer than the rest set the peak.

Read from the run's batch lengths (:attr:`~lightning_vram.records.RunSummary.length_counts`): where the longest
batch is :data:`TAIL_RATIO` times the length :data:`TAIL_SHARE` of the batches do not exceed (the cap), the worst
batch is replayed two ways, each a remedy the advice offers where it lowers the replayed peak by
:data:`~lightning_vram.advice.rules.base.MIN_SAVING_SHARE`: cut to the cap (a
:class:`~lightning_vram.records.LengthChange`: truncate), and holding no more tokens than a batch at the cap (a
:class:`~lightning_vram.records.TokensPerBatchChange`: batch by tokens, so a long batch holds fewer sequences and
no sequence is cut). Bucketing by length alone is not a remedy for the peak: the longest bucket's batch has the
worst batch's shape, so the advice says so rather than offering it. The savings are always replayed: there is no
model of them.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_vram.advice.rules.base import MIN_SAVING_SHARE, Rule, replayed_reason
from lightning_vram.advice.savings import Saving, resolve_saving
from lightning_vram.records import (
    Advice,
    AdviceId,
    LengthChange,
    RunSummary,
    Severity,
    Simulation,
    StepChange,
    TokensPerBatchChange,
    TrainingLoop,
    TrainingSetup,
)
from lightning_vram.records.shapes import length_percentile
from lightning_vram.units import format_bytes, format_percent

ID = AdviceId.LONG_TAIL
TAIL_SHARE = 0.95
"""The cap offered: the length this share of the run's batches do not exceed (its 95th percentile)."""
TAIL_RATIO = 1.5
"""The longest batch must be this many times the cap for the tail to be worth cutting."""


def _cap(summary: RunSummary) -> tuple[int, int] | None:
    """The cap (the lengths' :data:`TAIL_SHARE` percentile) and the longest length, tokens; ``None``: no long tail."""
    counts = summary.length_counts
    cap = length_percentile(counts, TAIL_SHARE)
    if cap is None:
        return None
    longest = max(length for length, _ in counts)
    return (cap, longest) if longest >= TAIL_RATIO * cap else None


def _token_budget(summary: RunSummary, cap: int) -> int | None:
    """The tokens of a batch of the run's batch size at the cap; ``None`` where a batch holds one sequence."""
    return summary.batch_size * cap if summary.batch_size is not None and summary.batch_size > 1 else None


def long_tail_changes(summary: RunSummary, setup: TrainingSetup) -> tuple[StepChange, ...]:
    """The worst batch cut to the cap, and batched by the tokens of a batch at the cap, where the tail is long."""
    found = _cap(summary)
    if found is None:
        return ()
    tokens = _token_budget(summary, found[0])
    return (LengthChange(found[0]),) if tokens is None else (LengthChange(found[0]), TokensPerBatchChange(tokens))


def _replayed(simulation: Simulation | None, kind: type[LengthChange | TokensPerBatchChange]) -> StepChange | None:
    """The change of ``kind`` the simulation replayed (declared from the lengths seen when the worst batch was)."""
    if simulation is None:
        return None
    return next((variant.change for variant in simulation.variants if isinstance(variant.change, kind)), None)


def _remedy(summary: RunSummary, simulation: Simulation | None, change: StepChange, cap: int) -> Saving | None:
    """The replayed saving of ``change`` where it lowers the peak enough, else ``None``.

    The batches within the cap stay as they are: where one of them was replayed higher than the worst batch with
    the change, the peak comes down only to it (the saving says so).
    """
    saving = resolve_saving(simulation, change, None, measured=summary.peak)
    if not isinstance(saving, Saving) or saving.predicted_peak_bytes is None:
        return None
    floor = max((peak for length, peak in summary.length_peaks if length <= cap), default=0)
    if floor > saving.predicted_peak_bytes:
        saving = replace(
            saving,
            saving_bytes=saving.saving_bytes - (floor - saving.predicted_peak_bytes),
            predicted_peak_bytes=floor,
            evidence=f"{saving.evidence}; a batch within {cap} tokens was replayed at {format_bytes(floor)}, which"
            " stays: the saving is counted to there",
        )
    return saving if saving.at_least(MIN_SAVING_SHARE) else None


CAP_LENGTH_CODE = '''def cap_length(batch, cap, lengths=None):
    """A tensor, dict or tuple batch cut to `cap` along each dimension past the first as long as its sequences
    (token ids, masks, token labels; a (B, L, L) mask along both); a label per sequence (B,) is kept whole, and
    `lengths`, the key or index of a tensor of each sequence's length, is clamped to `cap`. A batch padded on the
    left (its "attention_mask" ends every row with a token: Llama's tokenizers pad there) keeps each sequence's
    last `cap` tokens; cut at the right end, its shorter sequences would be left all padding."""
    values = list(batch.values()) if hasattr(batch, "items") else [batch] if torch.is_tensor(batch) else list(batch)
    length = next(value.shape[1] for value in values if torch.is_tensor(value) and value.dim() >= 2)
    mask = batch.get("attention_mask") if hasattr(batch, "items") else None
    left = torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[1] == length and bool(mask[:, -1].all())
    left = left and not bool(mask[:, 0].all())
    start = max(length - cap, 0) if left else 0

    def cut(key, value):
        if lengths is not None and key == lengths:
            return value.clamp(max=cap)
        if torch.is_tensor(value):
            for dim in range(1, value.dim()):
                if value.shape[dim] == length:
                    value = value.narrow(dim, start, min(cap, length))
        return value

    if hasattr(batch, "items"):
        return {key: cut(key, value) for key, value in batch.items()}
    if torch.is_tensor(batch):
        return cut(None, batch)
    values = [cut(index, value) for index, value in enumerate(batch)]
    return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)  # a namedtuple: by position
'''
"""The printed cut of a padded batch to the cap: the dimensions the replay cuts
(:func:`~lightning_vram.prediction.replay.batches.resize_length`: each past the first whose size is the batch's length,
dimension 1 of its first tensor with two or more), so a sequence's label, shape ``(B,)``, is left whole; a tensor of
each sequence's length is clamped to the cap where the user names it (``lengths=``): a step that indexes by it
(``output[arange(B), lengths - 1]``) replays on the cut batch, where fake tensors check no index, but would raise
in training. A dict batch padded on the left (``LlamaTokenizerFast`` pads there by default), told by its
``attention_mask``, is cut at its left end, the same shape: cut at the right, every sequence shorter than its length
less the cap was left all padding (a 300-token batch capped at 64 kept 64, 0, 0 and 0 tokens of sequences of 300, 40,
20 and 12). A namedtuple batch (``default_collate`` keeps a namedtuple sample's type) is rebuilt from its fields by
position: ``type(batch)(values)`` raised TypeError there."""

STREAM_BY_TOKENS_CODE = '''class BatchesByTokens(torch.utils.data.IterableDataset):
    """The stream's samples in lists, each padded batch within max_tokens (a longer sample alone), none cut.
    length: a sample's tokens (len for a tensor; lambda sample: len(sample["input_ids"]) for a dict)."""

    def __init__(self, samples, max_tokens, length=len):
        self.samples, self.max_tokens, self.length = samples, max_tokens, length

    def __iter__(self):
        batch, longest = [], 0
        for sample in self.samples:
            size = self.length(sample)
            if batch and max(longest, size) * (len(batch) + 1) > self.max_tokens:
                yield batch
                batch, longest = [], 0
            batch.append(sample)
            longest = max(longest, size)
        if batch:
            yield batch
'''
"""The printed batching by tokens of a stream (an ``IterableDataset``, which a DataLoader takes no batch sampler
over: it raises "expected unspecified batch_sampler option"): the stream yields each batch, and the DataLoader, with
``batch_size=None``, collates each."""

STREAM_RANKS_NOTE = (
    "Batching by tokens is not offered: over a stream (an IterableDataset) on several ranks, each rank's stream of"
    " batches by tokens holds another number of batches (its own sequences' lengths decide it, and a stream cannot"
    " be counted beforehand to even them), and ranks step together: one that runs out first leaves the others"
    " waiting on its gradients."
)
"""Why batching by tokens is withheld over an ``IterableDataset`` on several ranks: the printed ``BatchesByTokens``
applied to each rank's share of a stream split by rank gave 24 and 25 batches from 256 sequences each (a DDP run
then hangs on the rank with more), and a stream's batches, unlike a list of batches, cannot be padded to one count
beforehand as :func:`_rank_share` does."""


def _stream_on_ranks(setup: TrainingSetup) -> bool:
    """Whether ``setup`` reads a stream on several ranks, where batching by tokens is not offered."""
    return setup.iterable_dataset and setup.world_size > 1


_Remedy = tuple[str, Saving, str]
"""One remedy offered: its title (without the saving), its replayed saving, and its text with the code."""


def long_tail(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> Advice | None:
    """A few batches far longer than the rest, and the worst one replayed capped or batched by tokens saves enough."""
    cap_change = _replayed(simulation, LengthChange)
    tokens_change = _replayed(simulation, TokensPerBatchChange)
    found = _cap(summary)
    if found is None or not isinstance(cap_change, LengthChange):
        return None
    counts = summary.length_counts
    total = sum(count for _, count in counts)
    within = sum(count for length, count in counts if length <= cap_change.length)
    longest = found[1]
    if within < TAIL_SHARE * total:  # the lengths seen since the replay moved the percentile past its cap
        return None
    cap = cap_change.length
    offered = (
        _capped(summary, simulation, cap_change),
        _by_tokens(summary, setup, simulation, tokens_change, cap, longest),
    )
    remedies = [remedy for remedy in offered if remedy is not None]
    if not remedies:
        return None
    title, saving, _ = remedies[0]
    return Advice(
        id=ID,
        severity=Severity.INFO,
        title=f"{title} to lower the peak by about {format_bytes(saving.saving_bytes)}",
        detail=(
            f"{format_percent(within / total)} of the batches are at most {cap} tokens long, but the longest is"
            f" {longest}: the few long ones set the peak.\n"
            + "\n".join(text for _, _, text in remedies)
            + (f"\n{STREAM_RANKS_NOTE}" if _stream_on_ranks(setup) and tokens_change is not None else "")
            + "\nBucketing by length alone (a length-grouped sampler at a fixed batch size) does not lower this"
            " peak: the longest bucket's batch has the worst batch's shape."
        ),
        evidence=(
            f"batch lengths seen: {total} batches, {within} of them at most {cap} tokens, the longest {longest}; "
            + "; ".join(remedy.evidence for _, remedy, _ in remedies)
        ),
        estimated_saving_bytes=saving.saving_bytes,
        saving_basis=saving.basis,
        predicted_peak_bytes=saving.predicted_peak_bytes,
    )


def _capped(summary: RunSummary, simulation: Simulation | None, change: LengthChange) -> _Remedy | None:
    """Truncating at the cap, where its replay saves enough: its title, saving and text."""
    cap = change.length
    saving = _remedy(summary, simulation, change, cap)
    if saving is None:
        return None
    return (
        f"Cap sequences at {cap} tokens",
        saving,
        f"Cap sequences at {cap} tokens (saves about {format_bytes(saving.saving_bytes)}; the tokens past the cap"
        " are no longer trained on: another model, validate it; a tensor of each sequence's length in the batch must"
        " be clamped to the cap too, as `lengths=` does):\n"
        "```python\n"
        f"tokenizer(texts, max_length={cap}, truncation=True)  # or cut the padded batch in your collate function:\n"
        "\n"
        f"{CAP_LENGTH_CODE}\n"
        f"batch = cap_length(batch, {cap})  # a tensor of each sequence's length in the batch, clamped:"
        f" cap_length(batch, {cap}, lengths=1), its index or key\n"
        "```",
    )


def _by_tokens(
    summary: RunSummary,
    setup: TrainingSetup,
    simulation: Simulation | None,
    change: StepChange | None,
    cap: int,
    longest: int,
) -> _Remedy | None:
    """Batching by tokens, where its replay saves enough: its title, saving and text (a batch sampler).

    Not over a stream on several ranks (:data:`STREAM_RANKS_NOTE`).
    """
    if not isinstance(change, TokensPerBatchChange) or _stream_on_ranks(setup):
        return None
    saving = _remedy(summary, simulation, change, cap)
    if saving is None:
        return None
    tokens = change.tokens
    return (
        f"Batch by tokens (at most {tokens:,} a batch)",
        saving,
        f"Or keep every token and batch by tokens, at most {tokens:,} a batch (a batch at the cap's), so a"
        f" {longest}-token batch holds {max(1, tokens // longest)} sequence(s) (saves about"
        f" {format_bytes(saving.saving_bytes)}; which sequences share a batch, their order and the steps an epoch"
        " has change: another model, validate it"
        + (
            "; a DataLoader takes no batch sampler over an IterableDataset, so the stream yields the batches):\n"
            f"```python\n{STREAM_BY_TOKENS_CODE}\nloader = DataLoader(BatchesByTokens(dataset, max_tokens={tokens}),"
            " batch_size=None, collate_fn=collate)\n```"
            if setup.iterable_dataset
            else ", and shuffle the list of batches each epoch):\n" + _sampler_code(tokens, setup)
        ),
    )


def _sampler_code(tokens: int, setup: TrainingSetup) -> str:
    """The printed batch sampler by tokens over a map-style dataset, split across ranks where there are several."""
    return (
        "```python\n"
        "def batches_by_tokens(lengths, max_tokens):\n"
        '    """Lists of sample indices, shortest first, each padded batch within max_tokens."""\n'
        "    batches, batch = [], []\n"
        "    for index in sorted(range(len(lengths)), key=lengths.__getitem__):\n"
        "        if batch and lengths[index] * (len(batch) + 1) > max_tokens:\n"
        "            batches.append(batch)\n"
        "            batch = []\n"
        "        batch.append(index)\n"
        "    return batches + [batch] if batch else batches\n"
        "\n"
        + (
            _rank_share(tokens, setup)
            if setup.world_size > 1
            else f"loader = DataLoader(dataset, batch_sampler=batches_by_tokens(lengths, max_tokens={tokens}),"
            " collate_fn=collate)\n"
        )
        + "```"
    )


def _rank_share(tokens: int, setup: TrainingSetup) -> str:
    """The loader of one rank's share of the batches, as many on every rank, where ``setup`` trains on several.

    A list of batches is no ``BatchSampler``: Lightning cannot put its ``DistributedSampler`` into it and raises
    ("Lightning can't inject a (distributed) sampler into your batch sampler") unless told not to try
    (``use_distributed_sampler=False``, Fabric's ``setup_dataloaders`` too), and a plain loop's loader would give every
    rank every batch. Ranks step together, so each takes the same number of batches: the first few are repeated to
    make up the count, as ``DistributedSampler`` repeats samples (dropping the rest would drop the longest batch, last
    in the list: the very sequences batching by tokens keeps).
    """
    if setup.loop is TrainingLoop.LIGHTNING:
        where = (
            "# in train_dataloader: rank, world_size = self.global_rank, self.trainer.world_size;"
            " and Trainer(..., use_distributed_sampler=False)"
        )
    elif setup.loop is TrainingLoop.FABRIC:
        where = (
            "# rank, world_size = fabric.global_rank, fabric.world_size;"
            " and fabric.setup_dataloaders(loader, use_distributed_sampler=False)"
        )
    else:
        where = "# rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()"
    return (
        f"{where}\n"
        f"batches = batches_by_tokens(lengths, max_tokens={tokens})  # shuffled with one seed on every rank\n"
        "batches += batches[: -len(batches) % world_size]  # as many on every rank: a few twice\n"
        "loader = DataLoader(dataset, batch_sampler=batches[rank::world_size], collate_fn=collate)  # its share\n"
    )


def why_not(summary: RunSummary, setup: TrainingSetup, simulation: Simulation | None = None) -> str | None:
    """Why the worst batch, replayed capped or batched by tokens, is not advised."""
    replayed = [change for kind in (LengthChange, TokensPerBatchChange) if (change := _replayed(simulation, kind))]
    why = (
        "the batch lengths seen since no longer have a long tail"
        if _cap(summary) is None
        else f"under the {format_percent(MIN_SAVING_SHARE)} of the peak the rule needs"
    )
    return replayed_reason(simulation, replayed, why)


RULE = Rule(ID, long_tail, long_tail_changes, why_not)
