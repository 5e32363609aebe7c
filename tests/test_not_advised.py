"""What the report did not advise: each remedy a rule weighed and left out says why, with the replay's figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from advice_summaries import healthy_setup, healthy_summary
from models import Classifier, loader, trainer
from replay_models import images, mlp, resnet, vectors
from simulations import GIB, MIB, checkpoint_summary, replayed, simulated
from torch.utils.data import Dataset, TensorDataset

from lightning_vram import VramMonitor
from lightning_vram.advice.checkpointing import recomputed_modules
from lightning_vram.advice.rules import activation_checkpointing
from lightning_vram.advice.rules.mixed_precision import NOT_ADVISED_OFF_CUDA
from lightning_vram.advice.rules.registry import not_advised
from lightning_vram.codec import report_from_dict
from lightning_vram.records import CheckpointChange, InplaceChange, PrecisionChange, Report, StepChange
from lightning_vram.render.html import render_html
from lightning_vram.render.text import markdown, summary_text, wrapped
from lightning_vram.units import format_bytes, format_percent

# What is not advised, with the replayed figure that answers it.
pytestmark = pytest.mark.replay

DATA = Path(__file__).parent / "data" / "reports"


def cpu_run(root: Path, network: torch.nn.Module, data: Dataset[object], batch_size: int) -> Report:
    """Three steps on the CPU with the step replayed and each declared change tried on it."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(root, [monitor], max_steps=3).fit(Classifier(network), loader(data, batch_size))
    assert monitor.report is not None and monitor.report.simulation is not None
    assert monitor.report.simulation.skipped is None
    return monitor.report


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """A ResNet-style CNN: BatchNorm and inplace ReLU."""
    return cpu_run(tmp_path_factory.mktemp("resnet"), resnet(), images(32), 8)


@pytest.fixture(scope="module")
def relu_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """An MLP whose activations are `nn.ReLU()`, out of place."""
    return cpu_run(tmp_path_factory.mktemp("relu"), mlp(), vectors(48), 16)


def reason(report: Report, rule: str) -> str:
    """The report's reason for not advising ``rule``."""
    return next(item.reason for item in report.not_advised if item.id == rule)


def figure(report: Report, change: StepChange) -> str:
    """The replayed figure of ``change`` in words, computed here from the report's simulation."""
    simulation = report.simulation
    assert simulation is not None and simulation.baseline is not None
    baseline = simulation.baseline.reported_bytes(simulation.baseline.reported_peak)
    variant = next(item for item in simulation.variants if item.change == change)
    assert variant.replayed is not None
    predicted = variant.replayed.reported_bytes(variant.replayed.reported_peak)
    saving = baseline - predicted
    return (
        f"replayed, {change.label} peaks at {format_bytes(predicted)}, {format_bytes(abs(saving))}"
        f" ({format_percent(abs(saving) / baseline)}) {'below' if saving >= 0 else 'above'} the replayed baseline's"
        f" {format_bytes(baseline)}"
    )


def test_a_cpu_run_is_told_why_bf16_is_not_advised_with_its_replayed_figure(resnet_run: Report) -> None:
    bf16 = PrecisionChange("bf16-mixed")
    assert "mixed-precision" not in {advice.id for advice in resnet_run.advice}
    assert reason(resnet_run, "mixed-precision") == f"{figure(resnet_run, bf16)}: {NOT_ADVISED_OFF_CUDA}"
    assert " below the replayed baseline's " in reason(resnet_run, "mixed-precision")  # bf16 lowers this peak


def test_relu_out_of_place_is_replayed_inplace_and_answered(relu_run: Report) -> None:
    assert relu_run.simulation is not None
    inplace = next(
        variant.change for variant in relu_run.simulation.variants if isinstance(variant.change, InplaceChange)
    )
    assert inplace == InplaceChange(("network.1", "network.3", "network.5"))
    assert "inplace-activations" not in {advice.id for advice in relu_run.advice}
    assert reason(relu_run, "inplace-activations") == (
        f"{figure(relu_run, inplace)}: ReLU saves its output already: inplace frees no saved tensor, at most its"
        " transient input"
    )


def test_a_healthy_data_loader_says_its_data_wait_share(resnet_run: Report) -> None:
    found = {item.id.value: item.reason for item in not_advised(healthy_summary(), healthy_setup(), None, ())}
    assert found["dataloader-workers"] == (
        "more DataLoader workers: data wait is 1.0% of step time (1.0 ms per step), under the 10.0% the rule needs"
    )
    assert found["pin-memory"] == "the DataLoader pins host memory already (pin_memory=True)"
    # nothing replayed: what only a replay weighs says so, what the measurements weigh gives their figures
    assert found["chunked-loss"] == (
        "not weighed by replay: no step was replayed (the replay is off, or no sampled step reached it)"
    )
    assert found["stale-gradients"] == "the peak is in backward, not forward"
    assert found["near-capacity"] == (
        "the peak (8.00 GiB) is 50.0% of the device's 16.00 GiB, under the 90% the rule needs, with no allocation"
        " retries or recovered out-of-memory"
    )
    share = format_percent(resnet_run.timing.data_wait_fraction)
    assert reason(resnet_run, "dataloader-workers").startswith(f"more DataLoader workers: data wait is {share} of")


def test_every_reasons_figure_is_the_simulations(resnet_run: Report, relu_run: Report) -> None:
    for report in (resnet_run, relu_run):
        assert report.simulation is not None
        quoted = 0
        for variant in report.simulation.variants:
            for item in report.not_advised:
                if f"replayed, {variant.change.label} peaks at" in item.reason:
                    assert figure(report, variant.change) in item.reason
                    quoted += 1
        assert quoted >= 1


def test_the_reasons_are_written_and_read_back(resnet_run: Report) -> None:
    listed = resnet_run.to_dict()["not_advised"]
    assert {"id": "mixed-precision", "reason": reason(resnet_run, "mixed-precision")} in listed
    assert report_from_dict(json.loads(json.dumps(resnet_run.to_dict()))).not_advised == resnet_run.not_advised
    older = report_from_dict(json.loads((DATA / "0.9.0" / "cpu.json").read_text()))
    assert older.not_advised == ()


def test_every_view_says_what_it_did_not_advise(resnet_run: Report) -> None:
    ids = ", ".join(str(item.id) for item in resnet_run.not_advised)
    assert "mixed-precision" in ids
    summary = summary_text(resnet_run, details="vram_report.md").splitlines()
    folded = wrapped(f"  not advised: {ids} (why: vram_report.md)", 80)
    assert summary[summary.index(folded[0]) : summary.index(folded[0]) + len(folded)] == folded  # one entry
    assert max(map(len, summary)) <= 80 and sum(line.startswith("  not advised") for line in summary) == 1
    text = markdown(resnet_run)
    assert text.index("## Advice") < text.index("### Not advised") < text.index("## Breakdown")
    assert '- `mixed-precision`: replayed, precision="bf16-mixed" peaks at' in text
    page = render_html(resnet_run)
    assert page.index("<h2>Advice</h2>") < page.index('<ul id="not-advised">') < page.index("<h2>Breakdown")
    assert "<li><code>mixed-precision</code>: replayed, precision=&quot;bf16-mixed&quot; peaks at" in page


def test_a_checkpointing_plan_under_the_threshold_says_what_it_saves() -> None:
    summary, setup = checkpoint_summary(), healthy_setup()
    plans = activation_checkpointing.changes(summary, setup)
    simulation = simulated(*(replayed(plan, 8 * GIB - 300 * MIB) for plan in plans))
    assert activation_checkpointing.RULE.advise(summary, setup, simulation) is None
    (found,) = [item for item in not_advised(summary, setup, simulation, ()) if item.id == "activation-checkpointing"]
    # Every plan replays to the same peak: the tie goes to the plan that recomputes the fewest modules.
    checkpoints = [change for change in plans if isinstance(change, CheckpointChange)]
    cheapest = min(checkpoints, key=lambda change: recomputed_modules(change.plan))
    assert found.reason == (
        f"replayed, {cheapest.label} peaks at {format_bytes(8 * GIB - 300 * MIB)}, 300.0 MiB (3.7%) below the"
        " replayed baseline's 8.00 GiB: saves 300.0 MiB (3.7% of the measured peak), under the 10.0% the rule needs"
    )


class TokenLSTM(torch.nn.Module):
    """Token ids -> Embedding(50, 16) -> a 2-layer LSTM(16, 32) -> the last step's Linear(32, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.emb(tokens))
        return self.head(outputs[:, -1])  # type: ignore[no-any-return]


def test_an_lstm_is_told_why_no_checkpointing_plan_lowers_its_peak(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    tokens = TensorDataset(torch.randint(0, 50, (16, 40), generator=generator), torch.randint(0, 5, (16,)))
    report = cpu_run(tmp_path, TokenLSTM(), tokens, 8)
    peak = report.peak
    assert peak is not None and peak.breakdown is not None and peak.breakdown.largest_part == "activations"
    assert "activation-checkpointing" not in {advice.id for advice in report.advice}
    lstm = next(profile for profile in report.modules if profile.name == "network.lstm")
    assert lstm.type == "LSTM" and lstm.activation_bytes == max(profile.activation_bytes for profile in report.modules)
    activations = peak.breakdown.activations
    entry = (
        f"activations are {format_percent(activations / peak.peak_bytes)} of the backward peak"
        f" ({format_bytes(activations)} of {format_bytes(peak.peak_bytes)}), but checkpointing consecutive child"
        " modules of any module one by one would not lower it: network.lstm (LSTM) saves"
        f" {format_bytes(lstm.activation_bytes)} in its own ops, with no child modules, and a checkpoint of it would"
        " recompute them all at once in backward; split its forward into child modules called in turn (for a"
        " multi-layer nn.LSTM, one nn.LSTM per layer) to checkpoint them one by one"
    )
    assert {"id": "activation-checkpointing", "reason": entry} in report.to_dict()["not_advised"]
    assert f"- `activation-checkpointing`: {entry}" in markdown(report)
