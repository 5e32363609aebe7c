"""Memory during one step: the replay's timeline (live bytes by part after every op) and its figure, read back."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from models import OPTIMIZERS, Classifier, loader, trainer
from replay_models import images, mlp, resnet, vectors
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import TensorDataset

from lightning_vram import Report, VramMonitor
from lightning_vram.codec import FormatError, report_from_dict
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay.timeline import MAX_POINTS, TimelineRecorder
from lightning_vram.records import (
    CheckpointChange,
    CheckpointPlan,
    Phase,
    ReplayedStep,
    SavingBasis,
    StepTimeline,
    advised_variant,
)
from lightning_vram.records.simulation_json import simulation_to_dict
from lightning_vram.render.figures import png_bytes
from lightning_vram.render.html import render_html
from lightning_vram.render.step_memory import PART_LABELS, step_memory_figure
from lightning_vram.render.tensorboard import MONITOR_RUN, STEP_MEMORY_TAG

# Memory during one step: the replay's timelines.
pytestmark = pytest.mark.replay

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _replayed(module: Classifier, batch: Any) -> tuple[ReplayedStep, StepTimeline]:
    result = Predictor(module, None, batch, warm_up=True).baseline()
    assert isinstance(result, ReplayedStep) and result.timeline is not None
    return result, result.timeline


@pytest.mark.parametrize(
    ("build", "data"),
    [
        (lambda: Classifier(resnet(), OPTIMIZERS["sgd_momentum"]), images),  # BatchNorm, inplace ReLU
        (lambda: Classifier(mlp(), OPTIMIZERS["adam"]), vectors),
    ],
    ids=["resnet", "mlp"],
)
def test_the_timeline_s_highest_point_is_the_replayed_peak_with_its_parts(build: Any, data: Any) -> None:
    torch.manual_seed(0)
    result, timeline = _replayed(build(), data(8)[:8])
    peak = timeline.peak
    assert max(point.total for point in timeline.points) == peak.total == result.peak.peak_bytes
    assert peak.phase is result.peak.phase
    # The parts at the peak add up to it; parameters and optimizer state are the counted ones throughout.
    assert peak.parameters + peak.gradients + peak.optimizer_state + peak.activations + peak.other == peak.total
    forward = result.phases[Phase.FORWARD].breakdown
    assert forward is not None
    assert {point.parameters for point in timeline.points} == {forward.parameters}
    assert {point.optimizer_state for point in timeline.points} == {forward.optimizer_state}
    assert min(point.other for point in timeline.points) >= 0
    # Each phase's highest point is its replayed peak.
    for phase, phase_peak in result.phases.items():
        assert max(point.total for point in timeline.points if point.phase is phase) == phase_peak.peak_bytes
    # Phases in step order, points in op order.
    assert [phase for phase, _ in timeline.phase_starts] == [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
    starts = [start for _, start in timeline.phase_starts]
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] < timeline.ops
    positions = [list(Phase).index(point.phase) for point in timeline.points]
    assert positions == sorted(positions)
    assert [point.op for point in timeline.points] == sorted(point.op for point in timeline.points)
    assert len(timeline.points) == timeline.ops + len(timeline.phase_starts)  # a short step keeps every sample


class WideTemporary(nn.Module):
    """Scales its input by a count made from a 16 MiB temporary that backward never needs."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            count = torch.ones(inputs.shape[0], 1 << 16, device=inputs.device).sum(dim=1, keepdim=True)
        return inputs * count


def test_a_forward_peak_names_the_module_running_at_it() -> None:
    module = Classifier(nn.Sequential(nn.Linear(32, 32), WideTemporary(), nn.Linear(32, 10)), OPTIMIZERS["sgd"])
    result, timeline = _replayed(module, (torch.randn(64, 32), torch.randint(0, 10, (64,))))
    assert timeline.peak.phase is Phase.FORWARD and result.peak.phase is Phase.FORWARD
    assert timeline.peak_module == "network.1"  # the WideTemporary
    assert timeline.peak_op == "sum"  # its output added while the temporary is still alive
    assert timeline.peak.other >= 64 << 18  # the temporary: 64 x 65,536 float32 values


def test_a_long_step_keeps_at_most_max_points_and_its_peak() -> None:
    torch.manual_seed(0)
    module = Classifier(mlp(width=16, depth=150), OPTIMIZERS["sgd"])
    result, timeline = _replayed(module, (torch.randn(4, 16), torch.randint(0, 10, (4,))))
    assert timeline.ops > MAX_POINTS
    assert len(timeline.points) <= MAX_POINTS
    assert timeline.peak.total == result.peak.peak_bytes


def test_the_recorder_keeps_each_window_s_highest_sample() -> None:
    generator = random.Random(0)
    totals = [generator.randrange(1000) for _ in range(10_000)]
    samples = iter(totals)
    current = [0]

    def live() -> int:
        return current[0]

    recorder = TimelineRecorder(live, lambda: (0, 0, 0, 0), lambda: None, max_points=100)
    recorder.start_phase(Phase.FORWARD)  # samples the 0 alive before any op
    for _ in totals:
        current[0] = next(samples)
        recorder.sample("add")
    timeline = recorder.finish()
    assert timeline is not None and timeline.ops == len(totals)
    assert len(timeline.points) <= 100
    assert timeline.peak.total == max(totals) and timeline.peak_op == "add"
    # Each kept point is a sample, and every sample lies in the window of a kept point beside it, no higher than it.
    all_totals = [0, *totals]  # by op number: the sample at the phase's start, then one after each op
    kept = [(point.op, point.total) for point in timeline.points]
    assert all(all_totals[op] == total for op, total in kept)
    bounds = [(0, kept[0][1]), *kept, (len(totals), kept[-1][1])]
    for (first, high), (last, other_high) in itertools.pairwise(bounds):
        assert max(all_totals[first : last + 1]) <= max(high, other_high)


@pytest.fixture(scope="module")
def advised_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    """A CNN whose activations hold its peak: checkpointing is advised with a simulated saving."""
    root = tmp_path_factory.mktemp("step_memory")
    torch.manual_seed(0)
    network = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 3, 32, 32, generator=generator), torch.randint(0, 10, (128,)))
    logger = TensorBoardLogger(root, name="tb")
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=None, console_summary=False)
    trainer(root, [monitor], max_steps=3, logger=logger).fit(Classifier(network, OPTIMIZERS["adam"]), loader(data, 64))
    assert monitor.report is not None
    return monitor.report, Path(logger.log_dir)


def _texts(figure: Figure) -> list[str]:
    return [artist.get_text() for artist in figure.findobj(Text)]


def test_the_figure_shows_the_baseline_and_the_advised_change_side_by_side(advised_run: tuple[Report, Path]) -> None:
    report, _ = advised_run
    advice = next(item for item in report.advice if item.saving_basis is SavingBasis.SIMULATED)
    variant = advised_variant(report.simulation, report.advice)
    assert variant is not None and variant.replayed is not None
    assert variant.replayed.reported_bytes(variant.replayed.reported_peak) == advice.predicted_peak_bytes
    figure = step_memory_figure(report)
    assert figure is not None
    assert png_bytes(figure).startswith(PNG_MAGIC)
    panels = [axes for axes in figure.axes if axes.get_title()]
    assert len(panels) == 2
    assert panels[0].get_ylim() == panels[1].get_ylim()  # one memory scale
    assert "baseline" in panels[0].get_title() and variant.change.label in panels[1].get_title()
    texts = _texts(figure)
    assert set(PART_LABELS.values()) <= set(texts)  # the legend
    assert {"forward", "backward", "optimizer"} <= set(texts)  # the phases
    assert sum(text.startswith("peak ") for text in texts) == 2  # each panel's peak, labelled


def test_without_a_simulated_advice_the_figure_has_one_panel(advised_run: tuple[Report, Path]) -> None:
    report, _ = advised_run
    figure = step_memory_figure(replace(report, advice=()))
    assert figure is not None
    assert len([axes for axes in figure.axes if axes.get_title()]) == 1
    assert step_memory_figure(replace(report, simulation=None)) is None


@pytest.mark.parametrize("advice", ["advised", "none"])
def test_the_figure_s_labels_stay_apart_and_inside_it(advised_run: tuple[Report, Path], advice: str) -> None:
    """A new user's trial: the peak's label ran into a phase's name ("peak 176.5 MiBackward"), and under one panel the
    legend ran past both edges ("eters" ... "temporari")."""
    report, _ = advised_run
    figure = step_memory_figure(report if advice == "advised" else replace(report, advice=()))
    assert figure is not None
    canvas = FigureCanvasAgg(figure)  # as png_bytes draws it
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = figure.findobj(Text)
    phases = [text.get_window_extent(renderer) for text in texts if text.get_text() in {"forward", "backward"}]
    peaks = [text.get_window_extent(renderer) for text in texts if text.get_text().startswith("peak ")]
    assert phases and peaks
    assert not [(peak, phase) for peak in peaks for phase in phases if peak.overlaps(phase)]
    (legend,) = figure.legends
    inside, box = legend.get_window_extent(renderer), figure.bbox
    assert box.x0 <= inside.x0 and inside.x1 <= box.x1 and box.y0 <= inside.y0, (inside, box)


@pytest.mark.figures
def test_the_html_report_and_tensorboard_carry_the_figure(advised_run: tuple[Report, Path]) -> None:
    report, log_dir = advised_run
    page = render_html(report)
    assert "<h2>Memory during one step</h2>" in page
    assert 'alt="memory during one step" src="data:image/png;base64,' in page
    events = EventAccumulator(str(log_dir / MONITOR_RUN), size_guidance={"images": 0})
    events.Reload()
    (picture,) = events.Images(STEP_MEMORY_TAG)
    assert picture.encoded_image_string.startswith(PNG_MAGIC)


def test_the_report_json_carries_the_two_drawn_timelines_and_reads_them_back(advised_run: tuple[Report, Path]) -> None:
    report, _ = advised_run
    simulation, advised = report.simulation, advised_variant(report.simulation, report.advice)
    assert simulation is not None and simulation.baseline is not None and advised is not None
    data = report.to_dict()
    written = data["simulation"]
    assert len(written["timeline"]["points"]) <= MAX_POINTS
    assert [variant.get("timeline") is not None for variant in written["variants"]] == [
        variant is advised for variant in simulation.variants
    ]
    read = report_from_dict(json.loads(json.dumps(data)))
    assert read.simulation is not None and read.simulation.baseline is not None
    assert read.simulation.baseline.timeline == simulation.baseline.timeline
    read_advised = advised_variant(read.simulation, read.advice)
    assert read_advised is not None and read_advised.replayed is not None and advised.replayed is not None
    assert read_advised.replayed.timeline == advised.replayed.timeline
    assert render_html(read) == render_html(report)  # the page drawn again from the file is the same
    # The checkpoint state carries no timeline; a file without one reads as not recorded.
    assert "timeline" not in (simulation_to_dict(simulation) or {})
    del written["timeline"]
    for variant in written["variants"]:
        variant.pop("timeline", None)
    older = report_from_dict(data)
    assert older.simulation is not None and older.simulation.baseline is not None
    assert older.simulation.baseline.timeline is None and step_memory_figure(older) is None


def test_a_mistyped_timeline_point_names_its_place(advised_run: tuple[Report, Path]) -> None:
    report, _ = advised_run
    data = report.to_dict()
    data["simulation"]["timeline"]["points"][3][1] = "sideways"
    with pytest.raises(FormatError, match=r"simulation\.timeline\.points\[3\]\[1\] must be one of"):
        report_from_dict(data)


class _Up(nn.Module):
    """A U-Net's up block: its ``block`` is checkpointed where ``forward`` calls it (no nn.Sequential segments)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.out = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


def test_a_checkpointed_replay_names_the_user_s_modules() -> None:
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _Up(), nn.Flatten(), nn.Linear(4 * 16 * 16, 10))
    batch = (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    predictor = Predictor(Classifier(network), None, batch, warm_up=True)
    baseline = predictor.baseline()
    plan = CheckpointPlan("network.1", (("network.1.block",),), None, 0, "network.1")
    checkpointed = predictor.replay(CheckpointChange(plan))
    assert isinstance(baseline, ReplayedStep) and isinstance(checkpointed, ReplayedStep)
    names = [row.name for row in checkpointed.modules]
    assert names == [row.name for row in baseline.modules]  # not network.1.block.first, the replay's wrapper
    assert {"network.1.block", "network.1.block.0", "network.1.block.2"} <= set(names)
    saved = {row.name: row.activation_bytes for row in checkpointed.modules}
    assert saved["network.1.block.0"] == 0 < saved["network.1.out"]  # counted under the user's name: checkpointed
