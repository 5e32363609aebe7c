"""Gradient accumulation in a plain or Fabric loop measured by ``VramSession``, declared or not.

A new user's trial (a Fabric loop accumulating 2 micro-batches): the session replayed its step as if every batch
stepped. The report's peak was the window's first micro-batch's with no word about it, its simulation table showed an
optimizer row measured at 0 B "within 1%", and a sampled later micro-batch was refused ("forward gradients replayed
0 bytes"). The session now takes ``accumulate_grad_batches`` and observes the window from the batches that end without
``before_optimizer_step``.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramSession
from lightning_vram.exceptions import VramMonitorWarning
from lightning_vram.records import Phase, Report, SavingBasis
from lightning_vram.render.text import summary_text
from lightning_vram.session.accumulation import AccumulationWindows

pytestmark = pytest.mark.replay

VOCABULARY, WIDTH, LENGTH, BATCH = 256, 64, 48, 8
WINDOW = 2


class TinyEncoder(nn.Module):
    """A transformer-ish language model: embedding, one encoder layer (attention, MLP, dropout), a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.1, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(ids)))


def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
    ids, targets = batch
    return nn.functional.cross_entropy(module(ids).flatten(0, 1), targets.flatten())


def train(
    loop: str,
    session: VramSession | None,
    declared: int | None = None,
    batches: int = 8,
    window: int = WINDOW,
    says_steps: bool = True,
) -> dict[str, Any]:
    """``batches`` micro-batches, the optimizer stepping every ``window``-th; what training left behind.

    ``says_steps``: the loop calls ``before_optimizer_step`` (a loop that does not zeroes the gradients before
    backward instead, as Lightning does, so that each forward pass holds the last step's).
    """
    torch.manual_seed(0)
    random.seed(0)
    model = TinyEncoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCABULARY, (batches * BATCH, LENGTH + 1), generator=generator)
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=BATCH, shuffle=True)
    trained: nn.Module = model
    stepped: Any = optimizer
    fabric = None
    if loop == "fabric":
        fabric = Fabric(accelerator="cpu", devices=1)
        trained, stepped = fabric.setup(model, optimizer)
        data = fabric.setup_dataloaders(data)
    if session is not None:
        declaring = {} if declared is None else {"accumulate_grad_batches": declared}
        session.start(model, [optimizer], dataloader=data, step_function=loss_of, **declaring)
    losses = []
    for index, batch in enumerate(data):
        if session is not None:
            session.batch_start(batch)
        loss = loss_of(trained, batch) / window
        if not says_steps:
            stepped.zero_grad()
        if session is not None:
            session.before_backward()
        if fabric is not None:
            fabric.backward(loss)
        else:
            loss.backward()  # type: ignore[no-untyped-call]
        if (index + 1) % window == 0:
            if session is not None and says_steps:
                session.before_optimizer_step()
            stepped.step()
            if says_steps:
                stepped.zero_grad()
        losses.append(loss.detach())
        if session is not None:
            session.batch_end()
    if session is not None:
        session.finish()
    return {
        "losses": losses,
        "weights": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "python rng": random.getstate(),
    }


@cache
def bare(loop: str, batches: int = 8, window: int = WINDOW, says_steps: bool = True) -> dict[str, Any]:
    return train(loop, None, batches=batches, window=window, says_steps=says_steps)


def same(left: Any, right: Any) -> bool:
    """Bitwise equality through tensors, dicts, lists and tuples."""
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    if isinstance(left, dict):
        return isinstance(right, dict) and left.keys() == right.keys() and all(same(left[k], right[k]) for k in left)
    if isinstance(left, (list, tuple)):
        return isinstance(right, (list, tuple)) and len(left) == len(right) and all(map(same, left, right))
    return bool(left == right)


def measured(
    loop: str, declared: int | None, sampled: int, batches: int = 8, window: int = WINDOW, says_steps: bool = True
) -> Report:
    session = VramSession(attribution_start_step=sampled, attribution_every_n_steps=None, console_summary=False)
    watched = train(loop, session, declared, batches, window, says_steps)
    assert same(bare(loop, batches, window, says_steps), watched)  # losses, weights, AdamW's state, both generators
    assert session.report is not None
    return session.report


def assert_replayed_as_a_window(report: Report, window: int = WINDOW) -> None:
    simulation = report.simulation
    assert simulation is not None and simulation.skipped is None, simulation and simulation.skipped
    assert simulation.accumulate_grad_batches == window
    match, baseline = simulation.match, simulation.baseline
    assert match is not None and match.matches, match
    assert baseline is not None and baseline.window_first is not None
    savings = {advice.saving_basis for advice in report.advice if advice.estimated_saving_bytes}
    assert savings == {SavingBasis.SIMULATED}


@pytest.mark.parametrize("declared", [None, WINDOW])
@pytest.mark.parametrize("loop", ["plain", "fabric"])
def test_a_sampled_first_micro_batch_is_said_so_and_matched_against_the_replayed_first(
    loop: str, declared: int | None
) -> None:
    report = measured(loop, declared, sampled=2)  # step 2 opens the second window: no optimizer step
    assert_replayed_as_a_window(report)
    simulation = report.simulation
    assert simulation is not None and simulation.match is not None and simulation.match.window_first
    # The window's stepping micro-batch is sampled too: the report's peak is measured on it, holding the window's
    # gradients, and says so (the first micro-batch's peak held none).
    peak = report.peak
    assert peak is not None and (peak.step, peak.micro_batch) == (3, 2) and Phase.OPTIMIZER in report.phases
    assert peak.breakdown is not None and peak.breakdown.gradients > 0
    text = summary_text(report, width=400)
    assert "of step 3 (micro-batch 2 of 2, which steps the optimizer)" in text and "no optimizer entry" not in text
    # The advice's figures are the steady micro-batch's, which holds the gradients the first one left.
    baseline = simulation.baseline
    assert baseline is not None and baseline.window_first is not None
    assert baseline.peak.peak_bytes > max(peak.peak_bytes for peak in baseline.window_first.values())


@pytest.mark.parametrize("declared", [None, WINDOW])
@pytest.mark.parametrize("loop", ["plain", "fabric"])
def test_a_sampled_stepping_micro_batch_is_matched_with_its_gradients_and_optimizer_step(
    loop: str, declared: int | None
) -> None:
    report = measured(loop, declared, sampled=3)  # the window's second micro-batch, which steps
    assert_replayed_as_a_window(report)
    simulation = report.simulation
    assert simulation is not None and simulation.match is not None and not simulation.match.window_first
    assert {part.phase for part in simulation.match.parts} == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    assert report.peak is not None and report.peak.step == 3 and Phase.OPTIMIZER in report.phases
    forward = report.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.gradients > 0  # the first micro-batch's, held into the second


@pytest.mark.parametrize(("window", "replayed"), [(4, 7), (3, 5)])
@pytest.mark.parametrize("loop", ["plain", "fabric"])
def test_an_undeclared_first_window_longer_than_the_steps_before_the_sampled_one_is_waited_for(
    loop: str, window: int, replayed: int
) -> None:
    # Sampled step 2 is the third micro-batch of a window of 4 (or the stepping one of a window of 3): no optimizer
    # state existed before it, and nothing said the loop accumulates. Its replay waits for the first optimizer step;
    # the window's next stepping micro-batch is sampled and replayed.
    report = measured(loop, None, sampled=2, batches=12, window=window)
    assert_replayed_as_a_window(report, window)
    simulation = report.simulation
    assert simulation is not None and simulation.match is not None
    assert simulation.match.step == replayed and not simulation.match.window_first
    assert report.peak is not None and report.peak.step == replayed and Phase.OPTIMIZER in report.phases


def test_a_loop_that_never_calls_before_optimizer_step_is_still_replayed() -> None:
    # Gradients zeroed before backward: each forward pass holds the last step's, as a micro-batch's would. Nothing
    # shows a window: the replay waits one batch, then runs as it did (every batch steps).
    report = measured("plain", None, sampled=2, window=1, says_steps=False)
    simulation = report.simulation
    assert simulation is not None and simulation.skipped is None and simulation.accumulate_grad_batches == 1
    assert simulation.match is not None and simulation.match.matches and simulation.match.step == 3


def test_a_declared_window_the_loop_does_not_run_warns_once_and_the_observed_one_is_used() -> None:
    session = VramSession(attribution_start_step=3, attribution_every_n_steps=None, console_summary=False)
    with pytest.warns(VramMonitorWarning, match=r"accumulate_grad_batches=4 was declared.* every 2 batch") as caught:
        train("plain", session, declared=4)
    assert len([w for w in caught if "was declared" in str(w.message)]) == 1
    assert session.report is not None
    assert_replayed_as_a_window(session.report)


@pytest.mark.parametrize(
    ("value", "error", "said"),
    [
        (0, ValueError, "accumulate_grad_batches must be >= 1, got 0"),
        (2.0, TypeError, "accumulate_grad_batches must be an int >= 1 or None, got 2.0 (float)"),
        (True, TypeError, "accumulate_grad_batches must be an int >= 1 or None, got True (bool)"),
    ],
)
def test_a_bad_accumulate_grad_batches_is_refused_at_start_naming_it(value: Any, error: type, said: str) -> None:
    session = VramSession(console_summary=False)
    with pytest.raises(error, match=said.replace("(", r"\(").replace(")", r"\)")):
        session.start(TinyEncoder(), [], accumulate_grad_batches=value)


def windows_after(stepping: str, resumed: bool = False, from_setup: bool = False) -> AccumulationWindows:
    """A window fed one batch a character: ``s`` steps, ``.`` does not."""
    windows = AccumulationWindows(from_setup=from_setup)
    if resumed:
        windows.resumed()
    for batch in stepping:
        if batch == "s":
            windows.optimizer_step()
            windows.optimizer_step()  # two optimizers: still one stepping batch
        windows.batch_end()
    return windows


def test_the_window_observed_is_the_longest_between_steps_an_epoch_end_and_a_resumed_tail_are_partial() -> None:
    assert windows_after("").window(1) == 1  # nothing observed: the set-up's own
    assert windows_after("...").window(3) == 3  # no step yet (or a loop that never says so)
    assert windows_after("...s").observed == 4
    assert windows_after("...s...s.s...s").observed == 4  # a short window at an epoch's end is a partial one
    assert windows_after(".s...s", resumed=True).observed == 4  # the tail before the first step is not a window
    assert windows_after(".s", resumed=True).observed is None
    assert windows_after("ssss").observed == 1
    # A set-up given (the callback's: the Trainer's own accumulate_grad_batches) stands; a declared one is checked.
    assert windows_after("...s", from_setup=True).window(2) == 2
    assert windows_after("...s").window(2) == 4


def test_a_replay_waits_once_where_no_window_is_known_and_no_step_came_before() -> None:
    assert not AccumulationWindows(declared=4).defers(2, 100)  # declared
    assert not AccumulationWindows(from_setup=True).defers(2, 100)  # a set-up given (a Trainer's)
    assert not AccumulationWindows().defers(2, 0)  # no gradients carried in: not a later micro-batch
    windows = windows_after("..")
    assert windows.resample_at(2) is None
    assert windows.defers(1, 100) and not windows.defers(2, 100)  # once a run
    windows.batch_end()
    assert windows.resample_at(3) is None  # no step yet
    windows.optimizer_step()
    windows.batch_end()
    assert windows.resample_at(4) == 7 and windows.resample_at(4) is None  # step 3 + a window of 4
    stepped_first = windows_after("..s")
    assert stepped_first.defers(2, 100)  # the first step is this batch's: its optimizer state is new
    assert stepped_first.resample_at(3) == 5
    assert not windows_after(".s.").defers(2, 100)  # a step came before: its state exists
