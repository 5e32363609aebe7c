"""The report's simulation section: its JSON and each advice's basis, the codec's round trip and refusals, and what
Markdown, HTML and the console show of predicted against measured."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from advice_summaries import (
    HEALTHY_BREAKDOWN,
    healthy_setup,
)
from simulations import BASELINE, BROKEN, GIB, MIB, checkpoint_summary, discarded, replayed, simulated

from lightning_vram import Report
from lightning_vram.advice.checkpointing import checkpoint_candidates
from lightning_vram.advice.report import build_report
from lightning_vram.codec import FormatError, report_from_dict
from lightning_vram.records import (
    BaselineMatch,
    BatchSizeChange,
    CheckpointChange,
    FitRow,
    FreeGradientsChange,
    InplaceChange,
    PartMatch,
    Phase,
    PrecisionChange,
    SavingBasis,
    Simulation,
)
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown, summary_text

# The report's simulation section.
pytestmark = pytest.mark.replay

# ------------------------------------------------------------------------------------------------ report and codec


def full_simulation() -> Simulation:
    summary = checkpoint_summary()
    plans = checkpoint_candidates(summary.modules)
    # Every counted part of every phase as measured; the replay's forward activations 3 MiB over.
    parts = [
        PartMatch(phase, part, value, value + (3 * MIB if (phase, part) == (Phase.FORWARD, "activations") else 0))
        for phase in Phase
        for part, value in HEALTHY_BREAKDOWN.to_dict().items()
        if part != "other" and value is not None
    ]
    match = BaselineMatch(step=5, parts=tuple(parts), tolerance=0.01)
    return replace(
        simulated(
            replayed(CheckpointChange(plans[0]), 6 * GIB),
            discarded(CheckpointChange(plans[1])),
            replayed(PrecisionChange("bf16-mixed"), 7 * GIB + 512 * MIB),
            replayed(InplaceChange(("body.1", "body.3")), 8 * GIB),
            replayed(FreeGradientsChange(), 7 * GIB),
            replayed(BatchSizeChange(16), 5 * GIB),
            device_max_batch_size=48,
            fit=(FitRow("T4 (16 GiB)", 16 * GIB, 60),),
        ),
        match=match,
        baseline=replace(BASELINE, loss_activation_bytes=MIB, notes=("aten._cudnn_rnn keeps a workspace",)),
    )


def report_with(simulation: Simulation | None) -> Report:
    summary = checkpoint_summary()
    return build_report(
        summary, healthy_setup(precision="32-true"), top_modules=3, ranks=(), not_measured=(), simulation=simulation
    )


def test_report_json_carries_the_simulation_and_each_advice_basis() -> None:
    report = report_with(full_simulation())
    data = report.to_dict()
    advice = {entry["id"]: entry for entry in data["advice"]}
    assert advice["activation-checkpointing"]["saving_basis"] == "simulated"
    assert advice["activation-checkpointing"]["predicted_peak_bytes"] == 6 * GIB
    assert advice["mixed-precision"]["saving_basis"] == "simulated"
    assert data["fit"] == [
        {
            "device": "T4 (16 GiB)",
            "capacity_bytes": 16 * GIB,
            "max_batch_size": 60,
            "basis": "simulated",
            "at_least": False,
            "allocator": None,
            "expandable_max_batch_size": None,
            "note": None,
        }
    ]
    section = data["simulation"]
    assert {key: section[key] for key in ("device_type", "seconds", "skipped", "step", "peak_bytes", "peak_phase")} == {
        "device_type": "cuda",
        "seconds": 1.5,
        "skipped": None,
        "step": 5,
        "peak_bytes": 8 * GIB,
        "peak_phase": "backward",
    }
    assert section["baseline"]["matches"] is True and section["baseline"]["parts"][3] == {
        "phase": "forward",
        "part": "activations",
        "measured_bytes": 3 * GIB,
        "replayed_bytes": 3 * GIB + 3 * MIB,
    }
    assert len(section["baseline"]["parts"]) == 12
    assert section["phases"]["backward"] == {"peak_bytes": 8 * GIB, "breakdown": HEALTHY_BREAKDOWN.to_dict()}
    kinds = [
        (variant["kind"], variant["predicted_peak_bytes"], variant["discarded"]) for variant in section["variants"]
    ]
    assert kinds == [
        ("checkpoint", 6 * GIB, None),
        ("checkpoint", None, BROKEN),
        ("precision", 7 * GIB + 512 * MIB, None),
        ("inplace", 8 * GIB, None),
        ("free-gradients", 7 * GIB, None),
        ("batch-size", 5 * GIB, None),
    ]
    assert section["variants"][3]["parameters"] == {"modules": ["body.1", "body.3"]}
    assert section["variants"][5]["change"] == "batch size 16" and section["device_max_batch_size"] == 48
    json.dumps(data, allow_nan=False)


def test_report_round_trips_with_its_simulation() -> None:
    report = report_with(full_simulation())
    rebuilt = report_from_dict(json.loads(json.dumps(report.to_dict())))
    assert rebuilt.to_dict() == report.to_dict()
    assert rebuilt.simulation is not None and report.simulation is not None
    assert [variant.change for variant in rebuilt.simulation.variants] == [
        variant.change for variant in report.simulation.variants
    ]
    assert rebuilt.simulation.match == report.simulation.match
    assert rebuilt.advice == report.advice and rebuilt.fit == report.fit
    skipped = Simulation(
        "cuda", None, None, "manual optimization: the replay follows automatic optimization only", (), 0.0
    )
    for simulation in (skipped, None):
        plain = report_with(simulation)
        assert report_from_dict(plain.to_dict()).to_dict() == plain.to_dict()


def test_a_report_written_before_the_replay_still_reads() -> None:
    data = report_with(full_simulation()).to_dict()
    del data["simulation"]
    for entry in data["advice"]:
        del entry["saving_basis"], entry["predicted_peak_bytes"]
    for row in data["fit"]:
        del row["basis"]
    report = report_from_dict(data)
    assert report.simulation is None
    assert all(advice.saving_basis is None and advice.predicted_peak_bytes is None for advice in report.advice)
    assert [row.basis for row in report.fit] == ["modelled"]


def mistyped(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    data = report_with(full_simulation()).to_dict()
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("advice", 0, "saving_basis"), "guessed", "advice[0].saving_basis must be one of ['simulated', 'modelled']"),
        (("advice", 0, "predicted_peak_bytes"), "1", "advice[0].predicted_peak_bytes must be an integer, got str"),
        (("fit", 0, "basis"), None, "fit[0].basis must be a string, got null"),
        (("fit", 0, "basis"), "measured", "fit[0].basis must be one of"),
        (("simulation",), [], "report.simulation must be an object, got list"),
        (("simulation", "seconds"), "1", "report.simulation.seconds must be a number, got str"),
        (("simulation", "variants", 0, "kind"), "teleport", "report.simulation.variants[0].kind must be one of"),
        (("simulation", "variants", 0, "parameters", "units", 0, 0), 1, "units[0][0] must be a string, got int"),
        (
            ("simulation", "variants", 2, "phases", "sideways"),
            {},
            "must be one of ['forward', 'backward', 'optimizer']",
        ),
        (
            ("simulation", "variants", 0, "phases"),
            None,
            "variants[0]: a change neither replayed (phases) nor discarded",
        ),
        (("simulation", "baseline", "parts", 0, "part"), "weights", "parts[0].part must be one of"),
        (
            ("simulation", "baseline", "matches"),
            "yes",
            "report.simulation.baseline.matches must be true, false or null",
        ),
        (("simulation", "phases", "forward", "peak_bytes"), -1, "peak_bytes must be >= 0, got -1"),
    ],
    ids=lambda value: str(value)[:24],
)
def test_mistyped_simulation_fields_are_refused(path: tuple[str | int, ...], value: Any, message: str) -> None:
    with pytest.raises(FormatError) as error:
        report_from_dict(mistyped(path, value))
    assert message in str(error.value)


def test_markdown_html_and_console_show_predicted_against_measured() -> None:
    report = report_with(full_simulation())
    text = markdown(report)
    assert (
        "**Expected saving:** about 2.00 GiB of peak memory (simulated: replayed peak 6.00 GiB after the change)"
        in text
    )
    assert "## Simulation" in text
    # Measured and replayed counted parts, the run's allocator peaks and the replayed ones, per phase.
    assert "| forward | 6.00 GiB | 6.00 GiB | activations +0.10% | 7.00 GiB | 7.00 GiB |" in text
    assert "| backward | 6.00 GiB | 6.00 GiB | none | 8.00 GiB | 8.00 GiB |" in text
    assert "| batch size 16 | 5.00 GiB | -3.00 GiB | replayed, peak in backward |" in text
    assert "| checkpoint encoder.layers.0 to encoder.layers.3 (4 units) | n/a | n/a | discarded:" in text
    assert "discarded: RuntimeError: one of the" in text
    assert "| T4 (16 GiB) | 16.00 GiB | 60 | n/a | simulated |" in text  # no expandable-segments figure
    assert "A batch fits where its tensor peak and the CUDA context leave 10% of the card free." in text
    assert "- aten.\\_cudnn_rnn keeps a workspace" in text
    page = render_html(report)
    assert "<h2>Simulation</h2>" in page and '<table id="simulation-variants">' in page
    assert '<td class="n">60</td><td class="n">n/a</td><td>simulated</td>' in page  # the fit table's basis
    assert "about 2.00 GiB of peak memory (simulated: replayed peak 6.00 GiB after the change)" in page
    console = summary_text(report)
    assert console.splitlines()[3].startswith("  advice: Checkpoint `encoder.layers.0` to `encoder.layers.2` (3 units)")
    assert console.count("simulated)") == 2  # checkpointing and mixed precision; the others have no memory figure
    # A discarded change's reason is the user's exception text: escaped in both, never markup.
    hostile = replace(
        full_simulation(),
        variants=(discarded(FreeGradientsChange(), "ValueError: <img src=x onerror=alert(1)> | `x`"),),
    )
    assert "discarded: ValueError: \\<img src=x onerror=alert(1)\\> \\| \\`x\\` |" in markdown(report_with(hostile))
    assert "discarded: ValueError: &lt;img src=x onerror=alert(1)&gt; | `x`</td>" in render_html(report_with(hostile))
    modelled = markdown(report_with(None))
    assert "about 2.01 GiB of peak memory (modelled)" in modelled and "## Simulation" not in modelled
    skipped = Simulation(
        "cpu", None, None, "manual optimization: the replay follows automatic optimization only", (), 0.0
    )
    assert (
        "The step was not replayed: manual optimization: the replay follows automatic optimization only. Every saving"
        " in this report is modelled." in markdown(report_with(skipped))
    )


def test_a_fit_table_served_by_the_simulated_allocator_says_so_with_the_expandable_batch() -> None:
    row = FitRow("T4 (16 GiB)", 16 * GIB, 60, SavingBasis.SIMULATED, allocator="", expandable_max_batch_size=72)
    report = report_with(replace(full_simulation(), fit=(row,)))
    assert report.fit[0].expandable_max_batch_size == 72
    text = markdown(report)
    assert "| GPU | capacity | batch | with expandable_segments:True | basis |" in text
    assert "| T4 (16 GiB) | 16.00 GiB | 60 | 72 | simulated |" in text
    assert (
        "A batch fits where the simulated CUDA caching allocator (torch defaults) serves its whole step in the"
        " card's memory less the CUDA context, no margin kept." in text
    )
    page = render_html(report)
    assert '<td class="n">60</td><td class="n">72</td><td>simulated</td>' in page
    assert "simulated CUDA caching allocator (torch defaults) serves its whole step" in page
    assert report_from_dict(report.to_dict()).fit == (row,)
