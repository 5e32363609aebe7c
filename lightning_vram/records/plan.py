""":func:`lightning_vram.plan.plan`'s result (:class:`Plan`): configurations best first, printed as a table, as JSON.

A row (:class:`PlanRow`) is one configuration: a GPU, how many of them (over how many nodes), the strategy, the
precision, activation checkpointing on or off, and the micro-batch with the gradient accumulation that keeps the
global batch; with each rank's predicted peak, whether it fits, and the predicted step time and throughput.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import asdict, dataclass
from typing import Any

from lightning_vram.units import GIB, format_bytes

WIDTH = 100
"""The columns the notes are wrapped to (the table's rows are narrower)."""
TABLE_ROWS = 20
"""The table prints at most this many rows, best first; ``to_dict`` has them all."""
MAX_NOTES = 5
"""The table lists at most this many notes; ``to_dict`` has them all."""
STRATEGY_LABELS = {
    "fsdp": "fsdp1",
    "deepspeed_stage_1": "zero1",
    "deepspeed_stage_2": "zero2",
    "deepspeed_stage_3": "zero3",
}
"""The table's short names of Lightning's strategy names (the others are their own)."""
ALLOCATED_MARK = "*"
"""Marks a peak/rank that is the allocated peak, where the others are the allocator model's reserved peaks."""
LEGEND = (
    "best first: fitting rows by samples/s per GPU, then fewer GPUs, then the lower peak. n: GPUs (nodes x each);"
    " fsdp1: Lightning's fsdp; zeroN: deepspeed_stage_N (ZeRO-1/2 hold two reduce buckets, 800 MB each in fp32 under"
    " Lightning's defaults); micro: size x accum."
)
"""The table's legend line."""


@dataclass(frozen=True)
class PlanRow:
    """One configuration and what its replay predicts for each of its ranks.

    ``gpu``: the card's name; ``gpu_bytes``: the memory CUDA can use on it. ``gpus``: ranks in all (``nodes`` nodes
    of ``gpus // nodes``). ``micro_batch`` samples a rank runs per forward and backward, ``accumulation`` of them per
    optimizer step. ``peak_bytes``: the rank's predicted allocated peak; ``reserved_bytes``: what the caching
    allocator model reserved serving it at this card's memory (``None``: no allocator simulated).
    ``fits``: whether the step fits the card (see :attr:`Plan.fits_rule`); ``shortfall``: where it does not, the
    request that failed. ``step_seconds``: the predicted optimizer step (all its micro-batches, the strategy's
    communication included); ``samples_per_second``: the global batch over it. ``method``: how the rank's memory
    was predicted (the strategy's real code replayed, or the replay with the strategy's arithmetic). ``phases``:
    each phase's predicted allocated peak in step order (phase name, bytes); ``parts``: the counted parts of the
    peak phase (parameters, gradients, optimizer state, activations, other), bytes.
    """

    gpu: str
    gpu_bytes: int
    gpus: int
    nodes: int
    strategy: str
    precision: str
    checkpointing: bool
    micro_batch: int | None
    accumulation: int
    peak_bytes: int
    reserved_bytes: int | None
    fits: bool
    shortfall: str | None = None
    step_seconds: float | None = None
    samples_per_second: float | None = None
    method: str = ""
    phases: tuple[tuple[str, int], ...] = ()
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def served_short(self) -> bool:
        """Whether the allocator model ran out before the step's peak.

        What it reserved is then under the allocated peak (a card smaller than the context reserves nothing).
        """
        return self.reserved_bytes is not None and not self.fits and self.reserved_bytes < self.peak_bytes

    @property
    def shown_bytes(self) -> int:
        """The table's peak/rank: the reserved peak, or the allocated one the step needs where none was reserved.

        Allocated where no allocator was simulated or the model ran out before the step's peak (:attr:`served_short`).
        """
        return self.reserved_bytes if self.shown_kind == "reserved" else self.peak_bytes  # type: ignore[return-value]

    @property
    def shown_kind(self) -> str:
        """What :attr:`shown_bytes` is: ``"reserved"`` (the allocator model's) or ``"allocated"`` (the peak alone)."""
        return "reserved" if self.reserved_bytes is not None and not self.served_short else "allocated"

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step over every rank (``None`` where the batch has no batch dimension)."""
        return None if self.micro_batch is None else self.micro_batch * self.accumulation * self.gpus


@dataclass(frozen=True)
class Plan:
    """Configurations to train in, best first: those that fit, then the most samples per second per GPU.

    ``batch_source`` says where the batch came from (given, the module's ``example_input_array``, a loader's first
    batch); ``global_batch``: samples per optimizer step every row keeps (``None``: each rank the batch's own size).
    ``allocator``: the caching allocator's settings every fit was simulated with (``PYTORCH_ALLOC_CONF``'s form,
    ``""`` for the defaults; ``None``: none simulated, a fit is the peak under the memory less the context);
    ``cuda_context_bytes``: what each card keeps outside the allocator. ``assumptions``: what the step time assumes
    (achieved fraction of peak, the links). ``left_out``: configurations not predicted and why (the time budget, a
    replay that failed). ``notes``: what the replays could not reproduce. ``seconds``: host seconds the plan took;
    ``replays``: the steps it replayed.
    """

    rows: tuple[PlanRow, ...]
    batch_source: str
    global_batch: int | None
    allocator: str | None
    cuda_context_bytes: int
    assumptions: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    replays: int = 0

    @property
    def fits(self) -> bool:
        """Whether any configuration fits."""
        return any(row.fits for row in self.rows)

    @property
    def best(self) -> PlanRow | None:
        """The first row: the best configuration that fits, else the best of those that do not (``None``: none)."""
        return self.rows[0] if self.rows else None

    @property
    def fits_rule(self) -> tuple[str, ...]:
        """What "fits" and the peak column meant for this plan, in lines of at most 100 characters."""
        context = format_bytes(self.cuda_context_bytes)
        if self.allocator is None:
            return (
                f"fits: the rank's peak under 90% of the card's memory less {context} (CUDA context)",
                "peak/rank: allocated (no caching allocator simulated)",
            )
        settings = f"PYTORCH_ALLOC_CONF={self.allocator}" if self.allocator else "PYTORCH_ALLOC_CONF: defaults"
        lines = [
            f"fits: the caching allocator model serves the step in the card's memory less {context} of context",
            f"peak/rank: reserved by that model ({settings}); allocated peaks in --json",
        ]
        if any(row.reserved_bytes is None for row in self.rows):
            lines.append(
                f"{ALLOCATED_MARK} allocated peak: a strategy's arithmetic (ZeRO, FSDP1) has no allocation sequence;"
                " it fits with 10% of the card free"
            )
        if any(row.served_short for row in self.rows):
            lines.append(
                f"{ALLOCATED_MARK} on a row that does not fit: the allocated peak the step needs (the allocator model"
                " ran out first; where, in --json)"
            )
        if any(row.step_seconds is None for row in self.rows):
            lines.append(
                "step, samples/s: - where the step was not timed (a card given by its memory has no published peaks)"
            )
        return tuple(lines)

    def __str__(self) -> str:
        """The table, best first, with the legend (what fits means, what the step time assumes) and the notes."""
        return plan_text(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: every row, bytes and seconds as numbers."""
        return plan_to_dict(self)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data."""
    return {
        "fits": plan.fits,
        "rows": [
            {
                **asdict(row),
                "phases": dict(row.phases),
                "parts": dict(row.parts),
                "global_batch": row.global_batch,
                "shown_bytes": row.shown_bytes,
                "shown_kind": row.shown_kind,
            }
            for row in plan.rows
        ],
        "batch_source": plan.batch_source,
        "global_batch": plan.global_batch,
        "allocator": plan.allocator,
        "fits_rule": " ".join(plan.fits_rule),
        "cuda_context_bytes": plan.cuda_context_bytes,
        "assumptions": list(plan.assumptions),
        "left_out": list(plan.left_out),
        "notes": list(plan.notes),
        "seconds": plan.seconds,
        "replays": plan.replays,
    }


def short_gpu(name: str) -> str:
    """A card's name cut for the table: its first model, without the memory in brackets or the cards beside it.

    >>> short_gpu("RTX 3090 / 4090, A10, L4 (24 GB)"), short_gpu("A100 80GB / H100 80GB"), short_gpu("T4 (16 GB)")
    ('RTX 3090', 'A100 80GB', 'T4')
    """
    return re.split(r" \(| / |, ", name, maxsplit=1)[0][:14]


def _seconds(seconds: float | None) -> str:
    """A step time: ``ms`` under a second, else seconds; ``-`` where none was predicted."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(rate: float | None) -> str:
    """Samples per second, three significant figures at most; ``-`` where none was predicted."""
    if rate is None:
        return "-"
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def _memory(row: PlanRow) -> str:
    """The card's memory in GiB, to one decimal."""
    return f"{row.gpu_bytes / GIB:.1f}G"


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows of cells, the first three columns left-aligned and the others right-aligned, two spaces apart."""
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            cell.ljust(width) if index in (0, 3, 4) else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def plan_text(plan: Plan) -> str:
    """The plan as a person reads it in 80 to 100 columns: the headline, the rows best first, the legend, the notes."""
    fitting = sum(row.fits for row in plan.rows)
    best = plan.best
    if best is None:
        why = plan.left_out[0] if plan.left_out else (plan.notes[0] if plan.notes else None)
        lines = ["Plan: no configuration predicted" + (f": {why}" if why is not None else "")]
    elif best.fits:
        lines = [
            f"Plan: {fitting} of {len(plan.rows)} configurations fit; best: {best.gpus} x {short_gpu(best.gpu)},"
            f" {best.strategy}, {best.precision}" + (", checkpointing" if best.checkpointing else "")
        ]
    else:
        lines = [f"Plan: none of {len(plan.rows)} configurations fits"]
    lines.append(f"  batch: {plan.batch_source}" + _global_text(plan))
    table = [["GPU", "mem", "n", "strategy", "precision", "ckpt", "micro", "peak/rank", "fits", "step", "samples/s"]]
    for row in plan.rows[:TABLE_ROWS]:
        micro = "-" if row.micro_batch is None else f"{row.micro_batch}x{row.accumulation}"
        table.append(
            [
                short_gpu(row.gpu),
                _memory(row),
                str(row.gpus) if row.nodes == 1 else f"{row.nodes}x{row.gpus // row.nodes}",
                STRATEGY_LABELS.get(row.strategy, row.strategy),
                row.precision,
                "yes" if row.checkpointing else "no",
                micro,
                format_bytes(row.shown_bytes) + (" " if row.shown_kind == "reserved" else ALLOCATED_MARK),
                "yes" if row.fits else "NO",
                _seconds(row.step_seconds),
                _rate(row.samples_per_second),
            ]
        )
    if len(table) > 1:
        lines += _columns(table)
    if len(plan.rows) > TABLE_ROWS:
        lines.append(f"  ({len(plan.rows) - TABLE_ROWS} more rows in to_dict()['rows'] / --json)")
    lines += [f"  {line}" for line in plan.fits_rule]
    lines += textwrap.wrap(LEGEND, WIDTH, initial_indent="  ", subsequent_indent="  ")
    lines += [f"  {assumption}" for assumption in plan.assumptions]
    extra = [*(f"left out: {item}" for item in plan.left_out), *plan.notes]
    if extra:
        lines.append("Notes:")
        for note in extra[:MAX_NOTES]:
            lines += textwrap.wrap(note, WIDTH, initial_indent="  - ", subsequent_indent="    ")
        if len(extra) > MAX_NOTES:
            lines.append(f"  ({len(extra) - MAX_NOTES} more in to_dict()['left_out'] and ['notes'])")
    return "\n".join(lines)


def _global_text(plan: Plan) -> str:
    """The global batch every row keeps, in words."""
    if plan.global_batch is None:
        return "; each rank trains on the batch's own size per optimizer step"
    return f"; global batch {plan.global_batch} per optimizer step (micro-batch x accumulation x GPUs)"
