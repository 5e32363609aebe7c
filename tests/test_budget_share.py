"""``predict(..., memory_budget=...)`` beside the fit table: the budget search's share of the time, and the printout.

A new user's ``predict(gpt2, batch, memory_budget=...)`` spent every second of ``budget_seconds`` on the budget's
search and came back with an empty fit table; its printout said "peak 186.0 MiB (from 234.0 MiB)" (reserved) under
a header "peak 200.5 MiB in backward" (allocated), and "the code: prediction.budget.code" in place of the code.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from models import Classifier, loader
from test_memory_budget import Encoder, token_classes

from lightning_vram import predict
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records.advice import CheckpointPlan
from lightning_vram.records.budget import RESERVED_LEGEND, BudgetPlan
from lightning_vram.units import format_bytes

BUDGET_SECONDS = 6.0


@pytest.mark.replay
def test_a_budget_search_that_takes_all_it_is_given_leaves_the_fit_table_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, float | None] = {}

    def greedy_search(predictor: Predictor, *_: Any) -> str:
        seen["search"] = predictor.seconds_left()
        while not predictor.out_of_time():  # a search as long as its budget lets it be
            time.sleep(0.01)
        return "no plan: the search took every second it had"

    original = Predictor.fit_table

    def fit_table(self: Predictor, *args: Any, **kwargs: Any) -> Any:
        seen["fit"] = self.seconds_left()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(importlib.import_module("lightning_vram.predict"), "plan_for_budget", greedy_search)
    monkeypatch.setattr(Predictor, "fit_table", fit_table)
    torch.manual_seed(0)
    batch = next(iter(loader(token_classes(16, 32), 8)))
    prediction = predict(
        Classifier(Encoder()), batch, device_type="cpu", budget_seconds=BUDGET_SECONDS, memory_budget="1MiB"
    )
    search, fit = seen["search"], seen["fit"]
    assert search is not None and fit is not None
    assert search <= BUDGET_SECONDS / 2  # half of what the baseline left, at most
    assert fit > 0  # 0.x gave the table nothing: the search had run the clock out
    notes = "\n".join(prediction.notes)
    assert "time budget: the memory budget's search may take up to" in notes
    assert f"time budget: the fit table may take up to {fit:.1f} s of {BUDGET_SECONDS} s" in notes


def budget(basis: str, allocated: tuple[int, int] | None = None) -> BudgetPlan:
    """A plan that fits, peaking at 186 MiB (from 234 MiB) as ``basis`` counts, at ``allocated`` (after, before)."""
    plan = CheckpointPlan("model.layers", (("model.layers.0",), ("model.layers.1",)), None, 1 << 20)
    code = "from lightning_vram import checkpoint_keeping_buffers\nmodel.layers[0] = checkpoint(model.layers[0])"
    return BudgetPlan(
        1 << 30,
        True,
        plan,
        186 << 20,
        234 << 20,
        10,
        100,
        "`model.layers.0` to `model.layers.1` (2 units)",
        code,
        "least recomputed",
        3,
        basis,
        *(allocated or (186 << 20, 234 << 20)),
    )


def test_the_budget_lines_name_their_figure_and_print_the_code() -> None:
    lines = budget("live peak").lines()
    assert lines[:2] == [
        "Memory budget 1.00 GiB (live peak):",
        "  checkpoint `model.layers.0` to `model.layers.1` (2 units): peak 186.0 MiB live (from 234.0 MiB live), 10"
        " FLOPs recomputed (10.0% of the step)",
    ]
    assert lines[2:] == [
        "  least recomputed; the code:",
        "    from lightning_vram import checkpoint_keeping_buffers",
        "    model.layers[0] = checkpoint(model.layers[0])",
    ]


def test_a_reserved_budget_prints_the_allocated_peak_beside_it_and_writes_both() -> None:
    # The trial: "no plan fits: the smallest peak reached is 62.0 MiB" (reserved) where a CPU run measured 45.2 MiB.
    found = budget("reserved, simulated caching allocator", (180 << 20, 230 << 20))
    lines = found.lines()
    assert lines[:3] == [
        "Memory budget 1.00 GiB (reserved, simulated caching allocator):",
        f"  {RESERVED_LEGEND}",
        "  checkpoint `model.layers.0` to `model.layers.1` (2 units): peak 186.0 MiB reserved, 180.0 MiB allocated"
        " (from 234.0 MiB reserved, 230.0 MiB allocated), 10 FLOPs recomputed (10.0% of the step)",
    ]
    assert RESERVED_LEGEND.startswith("reserved: what the caching allocator holds from the device")
    assert RESERVED_LEGEND.endswith('live peak; `device_type="cpu"` budgets that instead)')
    # Where nothing fits, the step without checkpointing is given beside the smallest peak reached (the trial's
    # user could not tell where the 40.0 MiB reserved had started from).
    short = replace(found, fits=False, reason="the smallest peak reached is 186.0 MiB reserved")
    assert short.lines()[2] == (
        "  no plan fits: the smallest peak reached is 186.0 MiB reserved; without checkpointing the step peaks at"
        " 234.0 MiB reserved, 230.0 MiB allocated"
    )
    written = found.to_dict()
    assert (written["peak_bytes"], written["allocated_peak_bytes"]) == (186 << 20, 180 << 20)
    assert (written["baseline_peak_bytes"], written["baseline_allocated_bytes"]) == (234 << 20, 230 << 20)


@pytest.mark.replay
def test_predict_for_cuda_on_the_cpu_prints_allocated_beside_every_reserved_figure() -> None:
    torch.manual_seed(0)
    batch = next(iter(loader(token_classes(16, 32), 8)))
    # A budget no plan meets: the search replays every plan it has; seconds enough that a loaded CI machine finishes.
    asked = {"memory_budget": "1MiB", "fit_table": False, "budget_seconds": 300.0}
    prediction = predict(Classifier(Encoder()), batch, device_type="cuda", **asked)
    found = prediction.budget
    assert found is not None and found.reserved and found.peak_bytes is not None and not found.fits
    assert found.allocated_peak_bytes is not None and found.allocated_peak_bytes < found.peak_bytes
    text = str(prediction)
    print(text)
    expected = f"{format_bytes(found.peak_bytes)} reserved, {format_bytes(found.allocated_peak_bytes)} allocated"
    assert f"the smallest peak the search reached is {expected}, checkpointing" in text
    assert RESERVED_LEGEND in text
    assert text.count(" reserved") == text.count(" allocated")  # every reserved figure has its allocated one
    written = prediction.to_dict()["budget"]
    assert (written["peak_bytes"], written["allocated_peak_bytes"]) == (found.peak_bytes, found.allocated_peak_bytes)
    assert written["baseline_allocated_bytes"] == found.baseline_allocated_bytes is not None
    # The allocated figure is the baseline replay's allocated peak: the step without checkpointing, with CUDA's
    # dropout and attention kernels (replay/cuda_kernels.py). The CPU's kernels hold more, as a CPU run measures live;
    # a budget the step meets (the same baseline) spares the CPU run the search.
    assert prediction.step is not None
    assert found.baseline_allocated_bytes == prediction.step.peak.peak_bytes < found.baseline_peak_bytes
    torch.manual_seed(0)
    on_cpu = predict(Classifier(Encoder()), batch, device_type="cpu", **{**asked, "memory_budget": "1GiB"}).budget
    assert on_cpu is not None and on_cpu.basis == "live peak"
    assert on_cpu.baseline_peak_bytes is not None and found.baseline_allocated_bytes < on_cpu.baseline_peak_bytes
