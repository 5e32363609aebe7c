"""What the monitor advises: advice, a checkpointing plan, and the largest batch that fits a device.

Also the closed sets of advice, as enums whose values are the report's texts: its ids (:class:`AdviceId`), its
severities (:class:`Severity`) and where a saving comes from (:class:`SavingBasis`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from itertools import groupby


class ReportText(str, Enum):
    """A member of a closed set, compared, hashed, written to JSON and formatted as its text in the report."""

    def __str__(self) -> str:
        return str(self.value)


class AdviceId(ReportText):
    """The stable id of a piece of advice: new rules get new ids, an id never changes meaning."""

    ACTIVATION_CHECKPOINTING = "activation-checkpointing"
    MIXED_PRECISION = "mixed-precision"
    INPLACE_ACTIVATIONS = "inplace-activations"
    DATALOADER_WORKERS = "dataloader-workers"
    PIN_MEMORY = "pin-memory"
    STALE_GRADIENTS = "stale-gradients"
    CHUNKED_LOSS = "chunked-loss"
    OPTIMIZER_STATE = "optimizer-state"
    LARGE_LINEAR = "large-linear"
    ALLOCATOR_FRAGMENTATION = "allocator-fragmentation"
    BATCH_SIZE_HEADROOM = "batch-size-headroom"
    NEAR_CAPACITY = "near-capacity"
    EVALUATION_BATCH_SIZE = "evaluation-batch-size"
    LONG_TAIL = "long-tail"
    SHARDING_STAGE = "sharding-stage"
    OFFLOAD_OPTIMIZER = "offload-optimizer"


class Severity(ReportText):
    """How much an advice matters, most first (the order advice is listed in)."""

    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


class SavingBasis(ReportText):
    """Where an advice's byte saving, or a fit row's batch, comes from: replayed on the run's step, or a formula."""

    SIMULATED = "simulated"
    MODELLED = "modelled"


class CostBasis(ReportText):
    """What an advice's FLOP ratio (its change's replay against the baseline's) says of the step time."""

    RECOMPUTED_FORWARD = "recomputed forward"
    """Checkpointing: backward re-runs the checkpointed units' forward; the time grows with the FLOPs."""
    SAME_FLOPS = "same FLOPs"
    """The change runs the same ops (inplace activations, gradients freed earlier, the allocator's settings)."""
    TWO_HALF_BATCHES = "two half batches a step"
    """A halved batch with ``accumulate_grad_batches=2``: twice the replay's FLOPs take one step's place."""
    OTHER_PRECISION = "same FLOPs in another precision"
    """Mixed precision: the FLOPs are the same, their speed is not; the time change is not modelled from FLOPs."""
    FEWER_TOKENS = "fewer tokens a step"
    """A length cap or batching by tokens: the step does other work; the time is not modelled from FLOPs."""

    @property
    def modelled(self) -> bool:
        """Whether the FLOP ratio prices the step time (the same work, more or less of it)."""
        return self not in (CostBasis.OTHER_PRECISION, CostBasis.FEWER_TOKENS)


ZERO_FLOPS = 0.0005
"""A FLOP ratio this close to 1 prints as "+0.0% FLOPs": a recomputation of memory-bound ops only."""


@dataclass(frozen=True)
class Advice:
    """One piece of advice: what to change, the figures that fired it, and what it should save.

    ``estimated_saving_bytes`` is peak memory; ``estimated_saving_seconds`` is time per step (speed advice).
    ``saving_basis`` says where the byte saving comes from: ``"simulated"`` (the change was replayed on the run's own
    step under fake tensors), ``"modelled"`` (a formula over the measurements), ``None`` without a byte saving.
    ``predicted_peak_bytes`` is the replayed peak after the change, wherever the change was replayed (also without a
    byte saving: mixed precision advised for speed says what its replay predicts).
    ``estimated_cost_seconds`` is the change's expected step-time cost (its replay's FLOPs over the baseline's, minus
    one, times the run's median step time; 0 for the same FLOPs; ``None``: not modelled), ``flop_ratio`` that FLOP
    ratio and ``cost_basis`` what it says of the time (``None`` for both where no replay counted FLOPs).
    ``predicted_step_seconds`` is the step time predicted with the change: its replay's ops priced on the run's
    device (a roofline per op, :mod:`lightning_vram.prediction.timing`), times the run's measured median step time
    over the same prediction for its own step (``None``: not predicted: no step time measured, no ops counted, or a
    device without known peaks). ``replayed_change`` is the label of the replayed change behind a simulated saving
    (one of the report's ``simulation.variants``; two changes can replay to the same peak), ``None`` where the saving
    was not simulated or the report was written before it was recorded.
    """

    id: AdviceId
    severity: Severity
    title: str
    detail: str
    evidence: str
    estimated_saving_bytes: int | None
    estimated_saving_seconds: float | None = None
    saving_basis: SavingBasis | None = None
    predicted_peak_bytes: int | None = None
    estimated_cost_seconds: float | None = None
    flop_ratio: float | None = None
    cost_basis: CostBasis | None = None
    predicted_step_seconds: float | None = None
    replayed_change: str | None = None

    @property
    def cost_text(self) -> str | None:
        """The step-time cost in words (``None`` without a FLOP ratio).

        >>> def cost(seconds, ratio, basis):
        ...     return Advice(AdviceId.INPLACE_ACTIVATIONS, Severity.INFO, "t", "d", "e", 1, None, None, None, seconds,
        ...                   ratio, basis).cost_text
        >>> cost(0.0123, 1.31, CostBasis.RECOMPUTED_FORWARD)
        'costs about +12.3 ms a step (+31.0% FLOPs, recomputed forward)'
        >>> cost(0.0, 1.0, CostBasis.SAME_FLOPS)
        'costs no step time (same FLOPs)'
        >>> cost(None, 1.0, CostBasis.OTHER_PRECISION)
        'step time not modelled from FLOPs (same FLOPs in another precision)'
        >>> cost(None, 0.5, CostBasis.FEWER_TOKENS)
        'step time not modelled from FLOPs (fewer tokens a step: -50.0% FLOPs)'

        Where the recomputation counts no FLOPs (no matrix product, convolution or attention re-runs: torch stops a
        recomputation once it has what backward needs, before a convolution whose output is saved outside the unit
        runs again), its ops are memory-bound and priced by the bytes they move:

        >>> cost(0.0143, 1.0, CostBasis.RECOMPUTED_FORWARD)
        'costs about +14.3 ms a step (recomputed forward: memory-bound ops only, +0.0% FLOPs, priced by bytes moved)'
        """
        ratio, basis, seconds = self.flop_ratio, self.cost_basis, self.estimated_cost_seconds
        if ratio is None or basis is None:
            return None
        flops = f"{ratio - 1:+.1%} FLOPs, {basis}"
        if not basis.modelled:
            shown = str(basis) if basis is CostBasis.OTHER_PRECISION else f"{basis}: {flops.split(',')[0]}"
            return f"step time not modelled from FLOPs ({shown})"
        if seconds is None:
            return f"{flops}; no step time measured to price it"
        if seconds == 0 and basis is CostBasis.SAME_FLOPS:
            return f"costs no step time ({basis})"
        if basis is CostBasis.RECOMPUTED_FORWARD and abs(ratio - 1) < ZERO_FLOPS:
            flops = f"{basis}: memory-bound ops only, +0.0% FLOPs, priced by bytes moved"
        return f"costs about {1000 * seconds:+.1f} ms a step ({flops})"


@dataclass(frozen=True)
class NotAdvised:
    """A remedy a rule weighed and did not advise: its rule's ``id`` and, in one line, the measured ``reason``.

    The reason quotes the figure that decided it: a replayed change's predicted peak, or a measured share against
    the rule's threshold.
    """

    id: AdviceId
    reason: str


@dataclass(frozen=True)
class CheckpointPlan:
    """Which modules to checkpoint, and the activation bytes that should save at the peak.

    ``units`` are the checkpointed units, each the names of the children of ``container`` it runs, in order;
    ``forward_of`` is the module whose forward calls them (``container`` itself, or the parent of an
    ``nn.ModuleList``; ``""`` for the LightningModule). With ``sequential_segments``, ``container`` is an
    ``nn.Sequential`` run by ``checkpoint_sequential`` with that many segments (the last one not checkpointed).
    With ``switch``, ``container`` is a library model (transformers) whose own method of that name checkpoints
    every one of its layers, ``units`` (each stack's: encoder and decoder together).
    """

    container: str
    units: tuple[tuple[str, ...], ...]
    sequential_segments: int | None
    saving_bytes: int
    forward_of: str | None = None
    switch: str | None = None
    selective: tuple[str, ...] = ()
    """Units (by their first module) checkpointed selectively: the outputs of matrix products, convolutions and
    attention are kept, only the other ops recomputed (``SAVED_OPS`` in the printed code); the others whole."""
    shared: tuple[str, ...] = ()
    """One-module units of a layer list (``layers.0``) whose forward ran more often than its caller's: one block
    called as several layers, perhaps held at several places of the list (``nn.ModuleList([block] * 6)``), or of
    other lists (an encoder's and a decoder's). One wrapper stands at every place of the model holding the block, so
    that each of its calls is checkpointed."""

    def span_text(self, quote: str = "", kept: str = "") -> str:
        """The units in a few words, each name between ``quote``: the first module to the last, with their count.

        With how many of them are checkpointed selectively, followed by ``kept`` (what selective checkpointing keeps).
        Where the units' indices under one parent skip some, "N of the units from" the first to the last. Units
        named otherwise (a U-Net's ``enc1``, ``pool``, ``dec2``; layers of two parents) are listed, runs of indices as
        ranges: names tell no order, and "``enc1`` to ``dec2``" read as every child between them, ``up2`` too.

        >>> plan = CheckpointPlan("h", (("h.0",), ("h.1",), ("h.2",)), None, 0)
        >>> plan.span_text("`"), replace(plan, selective=("h.1", "h.2")).span_text(kept=": matmuls kept")
        ('`h.0` to `h.2` (3 units)', 'h.0 to h.2 (3 units, 2 selectively: matmuls kept)')
        >>> CheckpointPlan("h", (("h.1",), ("h.3",)), None, 0).span_text()
        '2 of the units from h.1 to h.3'
        >>> CheckpointPlan("h", (("h.3", "h.4"),), None, 0, selective=("h.3",)).span_text("`")
        '`h.3`+`h.4` (selectively)'
        >>> CheckpointPlan("", (("enc1",), ("enc2",), ("pool",), ("dec2",)), None, 0).span_text("`")
        '`enc1`, `enc2`, `pool` and `dec2` (4 units)'
        >>> CheckpointPlan("", (("conv1", "bn1"), ("layer1",), ("layer2",)), None, 0).span_text()
        'conv1+bn1, layer1 and layer2 (3 units)'
        >>> CheckpointPlan("net.layers", (("net.layers.0",),), None, 0, shared=("net.layers.0",)).span_text("`")
        '`net.layers.0` at every place of the model holding it'
        >>> CheckpointPlan("m", (("m.enc.0",), ("m.enc.1",), ("m.dec.0",)), None, 0).span_text()
        'm.enc.0-1 and m.dec.0 (3 units)'
        """
        names = [f"{quote}{name}{quote}" for unit in self.units for name in unit]
        selective = f"selectively{kept}" if self.selective else ""
        if len(self.units) == 1:
            if self.units[0][0] in self.shared:  # one block run as several layers: where the list holds it
                names[0] += " at every place of the model holding it"
            return "+".join(names) + (f" ({selective})" if selective else "")
        count = len(self.units)
        flat = [name for unit in self.units for name in unit]
        if not _indices_of_one_parent(flat):
            span, notes = _listed(self.units, quote), [f"{count} units"]
        elif _skips(flat):
            span, notes = f"{count} of the units from {names[0]} to {names[-1]}", []
        else:
            span, notes = f"{names[0]} to {names[-1]}", [f"{count} units"]
        if selective:
            notes.append(f"{len(self.selective)} {selective}")
        return f"{span} ({', '.join(notes)})" if notes else span


def _indices_of_one_parent(names: Sequence[str]) -> bool:
    """Whether modules ``names`` are all indices of one parent (``h.0``, ``h.2``), whose order their names tell.

    >>> _indices_of_one_parent(["h.0", "h.2"]), _indices_of_one_parent(["enc1", "dec2"])
    (True, False)
    >>> _indices_of_one_parent(["m.enc.0", "m.dec.0"])
    False
    """
    return len({name.rpartition(".")[0] for name in names}) == 1 and all(
        name.rpartition(".")[2].isdigit() for name in names
    )


def _listed(units: Sequence[tuple[str, ...]], quote: str) -> str:
    """``units`` listed, each name between ``quote``.

    A unit of several modules is joined by ``+``; consecutive units of one module that are indices of one parent are
    one range (``m.enc.0-1``).
    """
    parts: list[str] = []
    run: list[str] = []
    for unit in [*units, ()]:
        if len(unit) == 1:
            run.append(unit[0])
            continue
        parts += [f"{quote}{part}{quote}" for part in _range_parts(tuple(run))]
        run = []
        if unit:
            parts.append("+".join(f"{quote}{name}{quote}" for name in unit))
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _skips(names: Sequence[str]) -> bool:
    """Whether modules ``names``, indices of one parent, skip some (``False`` where they are not all indices).

    >>> _skips(["h.0", "h.1", "h.2"]), _skips(["h.1", "h.3"]), _skips(["h.norm", "h.head"]), _skips(["a.1", "b.3"])
    (False, True, False, False)
    """
    parents = {name.rpartition(".")[0] for name in names}
    indices = [name.rpartition(".")[2] for name in names]
    if len(parents) != 1 or not all(index.isdigit() for index in indices):
        return False
    numbers = [int(index) for index in indices]
    return numbers != list(range(numbers[0], numbers[0] + len(numbers)))


def layer_ranges(names: tuple[str, ...]) -> str:
    """Layers by name, consecutive indices of one parent as a range.

    >>> layer_ranges(("m.encoder.block.0", "m.encoder.block.1", "m.decoder.block.0", "m.decoder.block.1", "m.head"))
    'm.encoder.block.0-1, m.decoder.block.0-1 and m.head'
    """
    parts = _range_parts(names)
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _range_parts(names: tuple[str, ...]) -> list[str]:
    """``names``, consecutive indices of one parent each run as one range (:func:`layer_ranges`, unjoined)."""
    parts: list[str] = []
    for parent, group in groupby(names, key=lambda name: name.rpartition(".")[0]):
        indices = [name.rpartition(".")[2] for name in group]
        if all(index.isdigit() for index in indices) and [int(index) for index in indices] == list(
            range(int(indices[0]), int(indices[0]) + len(indices))
        ):
            span = indices[0] if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"
            parts.append(f"{parent}.{span}" if parent else span)
        else:
            parts += [f"{parent}.{index}" if parent else index for index in indices]
    return parts


@dataclass(frozen=True)
class FitRow:
    """The largest batch of this run predicted to fit on a device of ``capacity_bytes``."""

    device: str
    capacity_bytes: int
    max_batch_size: int
    basis: SavingBasis = SavingBasis.MODELLED
    """``"simulated"`` when solved on replayed batch sizes (checked by replay), ``"modelled"`` when extrapolated."""
    at_least: bool = False
    """The search stopped at its largest batch size, which still fit: the largest that fits is this or more."""
    allocator: str | None = None
    """The caching allocator's settings the row assumed (``PYTORCH_ALLOC_CONF`` as torch reads it, ``""`` for
    torch's defaults): the batch is the largest whose step the simulated allocator serves at the card's memory less
    the CUDA context, no margin kept. ``None``: the allocator was not simulated (the replayed tensor peak, with
    :data:`~lightning_vram.prediction.devices.BATCH_SAFETY_MARGIN` of the card kept free), or a report before 0.12."""
    expandable_max_batch_size: int | None = None
    """The largest batch with ``expandable_segments:True`` added to :attr:`allocator` (``None``: not simulated)."""
    note: str | None = None
    """Where batches above an answer are served again after some that are not (``"served to 336; 337-341 not served
    (fragmentation), served again at 342-352"``): each answer is the largest with every batch from the run's to it
    served. ``None``: no such gap, or a report before 0.12."""
    micro_batch_size: int | None = None
    """Where this run's batch does not fit (above :attr:`max_batch_size`): the micro-batch that keeps the run's global
    batch (its batch times ``accumulate_grad_batches``) with :attr:`accumulate_grad_batches`
    (:func:`keeping_global_batch`). ``None``: the batch fits, nothing fits, or a report before 0.13."""
    accumulate_grad_batches: int | None = None
    """The ``accumulate_grad_batches`` that goes with :attr:`micro_batch_size` (``None`` with it)."""
    global_batch_size: int | None = None
    """The run's global batch (samples per optimizer step) the micro-batch keeps (``None`` with it)."""
    own_accumulation: bool = False
    """Whether the run's own code accumulates the gradients (manual optimization, a plain or Fabric loop), where
    Lightning's ``accumulate_grad_batches`` does not apply: :attr:`accumulate_grad_batches` then counts the
    micro-batches that code would accumulate per optimizer step."""

    def keeping(self, batch_size: int, accumulate: int, own_accumulation: bool = False) -> FitRow:
        """The row with the micro-batch and accumulation that keep a run's global batch, where its batch does not fit.

        ``batch_size``: the run's batch (a micro-batch under accumulation); ``accumulate``: its
        ``accumulate_grad_batches``; ``own_accumulation``: as :attr:`own_accumulation`. Unchanged where the batch fits
        or nothing fits.

        >>> print(FitRow("A100", 80, 10).keeping(16, 4).accumulation_text)
        micro-batch 10 with accumulate_grad_batches=7 (global batch 70, the run's 64)
        >>> print(FitRow("A100", 80, 30).keeping(100, 1).accumulation_text)
        micro-batch 25 with accumulate_grad_batches=4 (global batch 100, as now)
        """
        kept = keeping_global_batch(batch_size * accumulate, self.max_batch_size)
        if batch_size <= self.max_batch_size or kept is None:
            return self
        micro, steps = kept
        global_batch = batch_size * accumulate
        return replace(
            self,
            micro_batch_size=micro,
            accumulate_grad_batches=steps,
            global_batch_size=global_batch,
            own_accumulation=own_accumulation,
        )

    @property
    def accumulation_text(self) -> str | None:
        """The micro-batch that keeps the run's global batch, as a report says it (``None`` where there is none)."""
        if self.micro_batch_size is None or self.accumulate_grad_batches is None or self.global_batch_size is None:
            return None
        return accumulation_text(
            self.micro_batch_size, self.accumulate_grad_batches, self.global_batch_size, self.own_accumulation
        )

    @property
    def batch_text(self) -> str:
        """The batch size as a report shows it: ``"at least 65536"`` where the search hit its bound.

        >>> FitRow("A100", 80, 65536, SavingBasis.SIMULATED, at_least=True).batch_text
        'at least 65536'
        """
        return f"at least {self.max_batch_size}" if self.at_least else str(self.max_batch_size)

    @property
    def expandable_text(self) -> str:
        """The batch with expandable segments as a report shows it (``"n/a"`` where not simulated).

        ``"at least"`` as in :attr:`batch_text` where the run's settings reached the search's bound and expandable
        segments did too.

        >>> FitRow("H200", 141, 150, SavingBasis.SIMULATED, allocator="", expandable_max_batch_size=162).expandable_text
        '162'
        >>> bound = FitRow("H200", 141, 65536, SavingBasis.SIMULATED, at_least=True, expandable_max_batch_size=65536)
        >>> bound.expandable_text
        'at least 65536'
        """
        wider = self.expandable_max_batch_size
        if wider is None:
            return "n/a"
        return f"at least {wider}" if self.at_least and wider >= self.max_batch_size else str(wider)

    @property
    def allocator_text(self) -> str:
        """What the row assumed of the allocator, in a few words.

        >>> FitRow("H200", 141, 150, SavingBasis.SIMULATED, allocator="").allocator_text
        'simulated allocator (torch defaults)'
        >>> FitRow("H200", 141, 150, SavingBasis.SIMULATED).allocator_text
        'tensor peak, 10% kept free'
        """
        if self.allocator is None:
            return "tensor peak, 10% kept free"
        return f"simulated allocator ({self.allocator or 'torch defaults'})"


def keeping_global_batch(global_batch: int, max_micro_batch: int) -> tuple[int, int] | None:
    """The micro-batch and ``accumulate_grad_batches`` that keep ``global_batch`` samples per optimizer step.

    Micro-batches of at most ``max_micro_batch``: the fewest that hold the global batch (``ceil``), each the smallest
    that keeps it with that many, so that their product is the global batch or, where it does not divide, a little
    more (less than one sample per micro-batch). ``None`` where no micro-batch fits (``max_micro_batch`` 0).

    >>> keeping_global_batch(100, 30)
    (25, 4)
    >>> keeping_global_batch(64, 10)
    (10, 7)
    """
    if max_micro_batch <= 0 or global_batch <= 0:
        return None
    steps = -(-global_batch // max_micro_batch)
    return -(-global_batch // steps), steps


def accumulation_text(micro_batch: int, accumulate: int, global_batch: int, own_accumulation: bool = False) -> str:
    """A micro-batch and its accumulation as a report says it, with the global batch they make beside the run's.

    ``own_accumulation``: the run's own code accumulates (manual optimization, where Lightning refuses
    ``accumulate_grad_batches``, or a plain or Fabric loop, which has no such setting).

    >>> accumulation_text(10, 7, 64)
    "micro-batch 10 with accumulate_grad_batches=7 (global batch 70, the run's 64)"
    >>> print(accumulation_text(10, 7, 64, own_accumulation=True))
    micro-batch 10, your code accumulating 7 per optimizer step, each loss divided by 7 (global batch 70, the run's 64)
    """
    kept = micro_batch * accumulate
    global_text = "as now" if kept == global_batch else f"the run's {global_batch}"
    how = (
        f", your code accumulating {accumulate} per optimizer step, each loss divided by {accumulate}"
        if own_accumulation
        else f" with accumulate_grad_batches={accumulate}"
    )
    return f"micro-batch {micro_batch}{how} (global batch {kept}, {global_text})"


EXPANDABLE_FEWER = (
    "their segment is mapped in 20 MiB pages, and a page that a live tensor shares with freed bytes stays mapped"
    " through the allocator's release-and-retry, so near the card's memory it can hold more than the default"
    " allocator, which frees whole cached segments and sizes a new one to 2 MiB"
)
"""Why a row's expandable-segments batch can be below its default one (torch's ``unmap_block`` unmaps only the
whole pages of a free block; the allocator model follows it)."""

EXPANDABLE_MORE = (
    "the default allocator serves a request only from one free block of one cached segment (freed bytes in"
    " different segments never join, and a rest of 1 MiB or less is handed out with the block), so near the card's"
    " memory it asks for a new segment where the free bytes would do; an expandable segment maps its free pages next"
    " to each other and grows at its end"
)
"""Why a row's expandable-segments batch can be above its default one: the fragmentation expandable segments exist
to avoid, as the allocator model follows torch (``should_split``, one segment per stream and pool grown by pages)."""


def expandable_lines(rows: Sequence[FitRow]) -> tuple[str, ...]:
    """Why expandable segments fit fewer or more batches than the default allocator, each reason once with its GPUs.

    >>> rows = [FitRow(name, 1, 100, allocator="", expandable_max_batch_size=n) for name, n in (("A", 98), ("B", 97))]
    >>> print(expandable_lines(rows)[0][:80])
    with expandable_segments:True fewer on A (98 against 100), B (97 against 100): t
    """
    lines = []
    for word, reason, sign in (("fewer", EXPANDABLE_FEWER, -1), ("more", EXPANDABLE_MORE, 1)):
        named = [
            f"{row.device} ({row.expandable_max_batch_size:,} against {row.max_batch_size:,})"
            for row in rows
            if row.allocator is not None
            and row.expandable_max_batch_size is not None
            and row.max_batch_size is not None
            and (row.expandable_max_batch_size > row.max_batch_size)
            - (row.expandable_max_batch_size < row.max_batch_size)
            == sign
        ]
        if named:
            lines.append(f"with expandable_segments:True {word} on {', '.join(named)}: {reason}")
    return tuple(lines)
