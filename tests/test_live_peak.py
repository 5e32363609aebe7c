"""The CPU's peak is every tensor alive: a sampled step's live count, checked against torch's own MemTracker.

On the CPU no allocator measures a peak; the sampled step counts every live tensor as it runs
(:mod:`lightning_vram.measure.live`). Its headline peak must agree with an independent count of the same step
(``torch.distributed._tools.mem_tracker.MemTracker``, in a second run without the monitor), the counted parts must
explain it with ``other`` for the rest, and the replay must predict the same live peaks it is judged on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from advice_models import LanguageModel, TinyGPT, tokens
from models import OPTIMIZERS, Classifier, loader, trainer
from replay_models import CausalLM, images, resnet, text
from torch.utils.data import Dataset
from torch.utils.weak import WeakIdKeyDictionary

from lightning_vram import Report, VramMonitor
from lightning_vram.measure.live import LiveTensors
from lightning_vram.records import Phase
from lightning_vram.testing import ScriptedBoundary, ScriptedProbe

SAMPLED = 1
"""The step both runs count."""


class MemTrackerStep(pl.Callback):
    """torch's MemTracker around training step :data:`SAMPLED`, told of the state alive when it starts."""

    def __init__(self) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.peak_bytes: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        if index == SAMPLED:
            self.tracker.track_external(module, *trainer.optimizers, *batch)
            self.tracker.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        if index == SAMPLED:
            self.tracker.__exit__(None, None, None)
            self.peak_bytes = self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


CASES: dict[str, tuple[Any, Any, int]] = {
    "gpt2": (lambda: CausalLM(), text, 4),
    "resnet": (lambda: Classifier(resnet(), OPTIMIZERS["sgd_momentum"]), images, 8),
}


def fit(root: Path, build: Any, data: Dataset[Any], batch_size: int, callback: pl.Callback) -> None:
    pl.seed_everything(0, verbose=False)
    trainer(root, [callback], max_steps=SAMPLED + 1).fit(build(), loader(data, batch_size))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cpu_peak_is_what_an_independent_live_count_sees(tmp_path: Path, name: str) -> None:
    build, data, batch_size = CASES[name]
    monitor = VramMonitor(
        attribution_start_step=SAMPLED, attribution_every_n_steps=None, console_summary=False, replay_budget_seconds=0
    )
    fit(tmp_path / "monitored", build, data(32), batch_size, monitor)
    independent = MemTrackerStep()
    fit(tmp_path / "independent", build, data(32), batch_size, independent)

    report = monitor.report
    assert report is not None and report.peak is not None and independent.peak_bytes is not None
    assert report.peak.step == SAMPLED
    assert report.peak.peak_bytes == pytest.approx(independent.peak_bytes, rel=0.01)
    for peak in report.phases.values():  # the counted parts explain each live peak, "other" the rest
        breakdown = peak.breakdown
        assert breakdown is not None and breakdown.other is not None
        assert breakdown.counted_bytes + breakdown.other == peak.peak_bytes
    peak = report.peak  # the batch, the logits, temporaries: alive, never counted
    assert peak.breakdown is not None and peak.breakdown.other is not None and peak.breakdown.other > 0


@pytest.mark.replay  # the replayed phase peaks, judged on the live count
def test_the_replay_predicts_the_live_peaks_it_is_judged_on(tmp_path: Path) -> None:
    monitor = VramMonitor(attribution_start_step=SAMPLED, attribution_every_n_steps=None, console_summary=False)
    fit(tmp_path, CASES["gpt2"][0], text(32), 4, monitor)
    report, simulation = monitor.report, monitor.session._advisor.simulation
    assert report is not None and simulation is not None and simulation.baseline is not None
    assert simulation.skipped is None and simulation.match is not None and simulation.match.matches
    replayed = simulation.baseline
    for phase, measured in report.phases.items():
        predicted = replayed.phases[phase]
        assert replayed.reported_bytes(predicted) == predicted.peak_bytes
        assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.001)


def test_live_counts_each_storage_once_and_forgets_it_when_freed() -> None:
    live = LiveTensors(torch.device("cpu"))
    weights = torch.zeros(256)  # 1 KiB alive before the step
    live.track([weights, weights[:10]])
    live.start()
    try:
        temporary = weights * 2  # 1 KiB more
        view = temporary[:100]
        del temporary
        assert live.live_bytes == 2048  # the view keeps the storage
        del view
        larger = torch.ones(512)  # 2 KiB: the forward segment peaks at 3 KiB
        live.close_segment(Phase.FORWARD)
        del larger
        live.close_segment(Phase.BACKWARD)
    finally:
        assert live.stop()
    assert live.phase_peaks == {Phase.FORWARD: 3072, Phase.BACKWARD: 3072}


def test_live_stands_aside_under_a_mode_entered_after_it_and_leaves_that_mode_in_place() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    live = LiveTensors(torch.device("cpu"))
    live.start()
    user = Counting()
    user.__enter__()
    try:
        assert not live.stop()  # not whole: the user's mode is still on top, left there
        torch.ones(4) * 2  # ops still run, through both modes
    finally:
        user.__exit__(None, None, None)
    # the live mode is still on the stack below: taking it off is what the caller's own exit would do
    live.__exit__(None, None, None)


def test_a_run_under_a_dispatch_mode_stands_aside_and_says_so(tmp_path: Path) -> None:
    """The monitor's saved-tensor hooks change the ops autograd runs (it saves tensors differently under them): the
    user's mode must see what it sees without the monitor, so sampled steps are not counted (tests/hostile/
    test_dispatch_modes.py compares the ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    monitor = VramMonitor(
        attribution_start_step=SAMPLED, attribution_every_n_steps=None, console_summary=False, replay_budget_seconds=0
    )
    with PassThrough():
        fit(tmp_path, CASES["resnet"][0], images(32), 8, monitor)
    report = monitor.report
    assert report is not None and (report.peak is None or report.peak.breakdown is None)
    assert any("attribution" in note.what and "dispatch mode" in note.reason for note in report.not_measured)


def test_on_cuda_the_allocator_is_the_live_count_and_none_runs(tmp_path: Path) -> None:
    seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    class Spy(pl.Callback):
        def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: torch.Tensor) -> None:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            seen[module] = _get_current_dispatch_mode()

    monitor = VramMonitor(
        attribution_start_step=0,
        console_summary=False,
        replay_budget_seconds=0,
        probe=ScriptedProbe([ScriptedBoundary(0, 0, 0)]),
    )
    pl.seed_everything(0, verbose=False)
    module = Classifier(resnet(), OPTIMIZERS["sgd"])
    trainer(tmp_path, [monitor, Spy()], max_steps=2).fit(module, loader(images(16), 8))
    assert seen[module] is None


# ------------------------------------------------------------------------------------ advice judged on the live peak


class FreesGradients(LanguageModel):
    """The stale-gradients advice applied by hand: the previous step's gradients freed at batch start."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for optimizer in self.trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)


def language_model_report(root: Path, module: pl.LightningModule) -> Report:
    monitor = VramMonitor(attribution_start_step=SAMPLED, attribution_every_n_steps=None, console_summary=False)
    pl.seed_everything(0, verbose=False)
    trainer(root, [monitor], max_steps=SAMPLED + 2).fit(module, loader(tokens(64, vocab=4096), 8))
    assert monitor.report is not None
    return monitor.report


@pytest.mark.replay  # the advice of a real run, which the replay informs
def test_stale_gradients_is_silent_where_freeing_them_frees_nothing_of_the_live_peak(tmp_path: Path) -> None:
    # A language model over a 4096-token vocabulary: its counted parts peak in forward (the gradients alive), but
    # what is alive peaks in backward (the log-probabilities, their gradient and the logits' gradient).
    before = language_model_report(
        tmp_path / "before", LanguageModel(TinyGPT(vocab=4096, layers=2), OPTIMIZERS["adam"])
    )
    peak, forward = before.peak, before.phases[Phase.FORWARD]
    assert peak is not None and peak.phase is Phase.BACKWARD and forward.breakdown is not None
    assert forward.breakdown.gradients > 0
    counted = {phase: p.breakdown.counted_bytes for phase, p in before.phases.items() if p.breakdown is not None}
    assert max(counted, key=lambda phase: counted[phase]) is Phase.FORWARD  # what the counted sums used to advise on
    assert all(advice.id != "stale-gradients" for advice in before.advice)
    # Applied anyway, it frees nothing of the peak: the silence is right.
    after = language_model_report(tmp_path / "after", FreesGradients(TinyGPT(vocab=4096, layers=2), OPTIMIZERS["adam"]))
    assert after.peak is not None and after.peak.peak_bytes == peak.peak_bytes


def test_a_compiled_model_keeps_the_counted_peaks_and_says_so(tmp_path: Path) -> None:
    monitor = VramMonitor(
        attribution_start_step=SAMPLED, attribution_every_n_steps=None, console_summary=False, replay_budget_seconds=0
    )
    module = Classifier(torch.compile(resnet(), backend="aot_eager"), OPTIMIZERS["sgd"])
    trainer(tmp_path, [monitor], max_steps=SAMPLED + 1).fit(module, loader(images(16), 8))
    report = monitor.report
    assert report is not None and report.peak is not None and report.peak.breakdown is not None
    assert report.peak.breakdown.other is None
    assert any("live peak" in note.what and "torch.compile" in note.reason for note in report.not_measured)


def test_the_live_count_runs_on_sampled_steps_only(tmp_path: Path) -> None:
    modes: list[bool] = []

    class Spy(pl.Callback):
        def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: torch.Tensor) -> None:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            modes.append(isinstance(_get_current_dispatch_mode(), LiveTensors))

    monitor = VramMonitor(
        attribution_start_step=1, attribution_every_n_steps=3, console_summary=False, replay_budget_seconds=0
    )
    pl.seed_everything(0, verbose=False)
    trainer(tmp_path, [monitor, Spy()], max_steps=6).fit(Classifier(resnet()), loader(images(48), 8))
    assert modes == [False, True, False, False, True, False]
