"""The JSON form of advice and fit rows, both ways."""

from __future__ import annotations

from typing import Any

from lightning_vram.records.advice import Advice, AdviceId, CostBasis, FitRow, NotAdvised, SavingBasis, Severity
from lightning_vram.records.json_reader import Reader, member_of


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    """One piece of advice (the schema's ``advice`` entries)."""
    return {
        "id": str(advice.id),
        "severity": str(advice.severity),
        "title": advice.title,
        "detail": advice.detail,
        "evidence": advice.evidence,
        "estimated_saving_bytes": advice.estimated_saving_bytes,
        "estimated_saving_seconds": advice.estimated_saving_seconds,
        "saving_basis": None if advice.saving_basis is None else str(advice.saving_basis),
        "predicted_peak_bytes": advice.predicted_peak_bytes,
        "estimated_cost_seconds": advice.estimated_cost_seconds,
        "flop_ratio": advice.flop_ratio,
        "cost_basis": None if advice.cost_basis is None else str(advice.cost_basis),
        "predicted_step_seconds": advice.predicted_step_seconds,
        "replayed_change": advice.replayed_change,
    }


def fit_row_to_dict(row: FitRow) -> dict[str, Any]:
    """One row of the report's ``fit`` table (the micro-batch that keeps the global batch only where there is one)."""
    kept = {
        "micro_batch_size": row.micro_batch_size,
        "accumulate_grad_batches": row.accumulate_grad_batches,
        "global_batch_size": row.global_batch_size,
        "own_accumulation": row.own_accumulation,
    }
    return {
        "device": row.device,
        "capacity_bytes": row.capacity_bytes,
        "max_batch_size": row.max_batch_size,
        "basis": str(row.basis),
        "at_least": row.at_least,
        "allocator": row.allocator,
        "expandable_max_batch_size": row.expandable_max_batch_size,
        "note": row.note,
        **(kept if row.micro_batch_size is not None else {}),
    }


def advice_from_dict(data: Any, where: str) -> Advice:
    """The advice :func:`advice_to_dict` wrote."""
    fields = Reader(data, where)
    return Advice(
        id=member_of(AdviceId, fields.text("id"), f"{where}.id"),
        severity=member_of(Severity, fields.text("severity"), f"{where}.severity"),
        title=fields.text("title"),
        detail=fields.text("detail"),
        evidence=fields.text("evidence"),
        estimated_saving_bytes=fields.optional_integer("estimated_saving_bytes", minimum=None),
        estimated_saving_seconds=fields.added(
            "estimated_saving_seconds", lambda reader, key: reader.optional_number(key, minimum=None), None
        ),
        # Both absent from reports written by 0.7.0 and earlier.
        saving_basis=(
            member_of(SavingBasis, fields.text("saving_basis"), f"{where}.saving_basis")
            if fields.has("saving_basis") and fields.raw("saving_basis") is not None
            else None
        ),
        predicted_peak_bytes=fields.optional_integer("predicted_peak_bytes")
        if fields.has("predicted_peak_bytes")
        else None,
        # The three absent from reports written before the time cost.
        estimated_cost_seconds=fields.added(
            "estimated_cost_seconds", lambda reader, key: reader.optional_number(key, minimum=None), None
        ),
        flop_ratio=fields.added("flop_ratio", lambda reader, key: reader.optional_number(key), None),
        cost_basis=_cost_basis(fields.optional_text("cost_basis") if fields.has("cost_basis") else None, where),
        # Absent from reports written before the step time.
        predicted_step_seconds=fields.added(
            "predicted_step_seconds", lambda reader, key: reader.optional_number(key), None
        ),
        # Absent from reports written before it was recorded.
        replayed_change=fields.added("replayed_change", lambda reader, key: reader.optional_text(key), None),
    )


def _cost_basis(text: str | None, where: str) -> CostBasis | None:
    """The advice's ``cost_basis`` from its ``text`` (one of :class:`CostBasis`'s, or ``None``)."""
    return None if text is None else member_of(CostBasis, text, f"{where}.cost_basis")


def fit_row_from_dict(data: Any, where: str) -> FitRow:
    """The fit row :func:`fit_row_to_dict` wrote (a row from 0.7.0 or earlier: modelled, exact)."""
    fields = Reader(data, where)
    basis = SavingBasis.MODELLED  # absent up to 0.7.0: extrapolated
    if fields.has("basis"):
        basis = member_of(SavingBasis, fields.text("basis"), f"{where}.basis")
    at_least = fields.flag("at_least") if fields.has("at_least") else False  # absent up to 0.7.0: exact
    return FitRow(
        fields.text("device"),
        fields.integer("capacity_bytes"),
        fields.integer("max_batch_size"),
        basis,
        at_least,
        # Both absent up to 0.11: the allocator not simulated.
        allocator=fields.optional_text("allocator") if fields.has("allocator") else None,
        expandable_max_batch_size=(
            fields.optional_integer("expandable_max_batch_size") if fields.has("expandable_max_batch_size") else None
        ),
        note=fields.optional_text("note") if fields.has("note") else None,  # absent up to 0.12's first reports
        # The three absent up to 0.12: no micro-batch given.
        micro_batch_size=_optional_integer(fields, "micro_batch_size"),
        accumulate_grad_batches=_optional_integer(fields, "accumulate_grad_batches"),
        global_batch_size=_optional_integer(fields, "global_batch_size"),
        # Absent up to this version's first reports: Lightning's accumulate_grad_batches.
        own_accumulation=fields.flag("own_accumulation") if fields.has("own_accumulation") else False,
    )


def _optional_integer(fields: Reader, name: str) -> int | None:
    """An optional integer field, ``None`` where the report has no such field."""
    return fields.optional_integer(name) if fields.has(name) else None


def not_advised_to_dict(item: NotAdvised) -> dict[str, Any]:
    """One remedy weighed and not advised (the schema's ``not_advised`` entries)."""
    return {"id": str(item.id), "reason": item.reason}


def not_advised_from_dict(data: Any, where: str) -> NotAdvised:
    """The entry :func:`not_advised_to_dict` wrote."""
    fields = Reader(data, where)
    return NotAdvised(id=member_of(AdviceId, fields.text("id"), f"{where}.id"), reason=fields.text("reason"))
