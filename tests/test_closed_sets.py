"""Closed sets (advice ids, severities, saving bases, change kinds) are enums whose values are the report's texts."""

from __future__ import annotations

import json

import pytest

from lightning_vram.codec import FormatError
from lightning_vram.records import Advice, AdviceId, ChangeKind, FreeGradientsChange, SavingBasis, Severity
from lightning_vram.records.advice_json import advice_from_dict, advice_to_dict


def advice(**fields: object) -> dict[str, object]:
    written = advice_to_dict(
        Advice(AdviceId.STALE_GRADIENTS, Severity.WARNING, "t", "d", "e", 4096, saving_basis=SavingBasis.SIMULATED)
    )
    return {**written, **fields}


def test_members_are_written_and_shown_as_their_texts() -> None:
    written = json.dumps(advice())
    assert '"id": "stale-gradients", "severity": "warning"' in written
    assert '"saving_basis": "simulated"' in written
    assert f"{Severity.CRITICAL} {AdviceId.NEAR_CAPACITY} {FreeGradientsChange().kind}" == (
        "critical near-capacity free-gradients"
    )
    assert Severity.INFO == "info"


def test_texts_read_back_as_members() -> None:
    read = advice_from_dict(advice(), "advice[0]")
    assert read.id is AdviceId.STALE_GRADIENTS
    assert read.severity is Severity.WARNING
    assert read.saving_basis is SavingBasis.SIMULATED
    assert [kind.value for kind in ChangeKind] == [
        "precision",
        "checkpoint",
        "inplace",
        "free-gradients",
        "batch-size",
        "length",
        "tokens-per-batch",
    ]


def test_an_unknown_advice_id_names_the_field_and_the_ids() -> None:
    with pytest.raises(
        FormatError, match=r"advice\[2\]\.id must be one of \['activation-checkpointing', .*got 'sharding'"
    ):
        advice_from_dict(advice(id="sharding"), "advice[2]")
