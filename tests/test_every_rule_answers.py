"""Every rule that applies to the run's device either advises or says why not, replayed or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from advice_summaries import HEALTHY_BREAKDOWN, blocks, healthy_setup, healthy_summary, peak
from models import Classifier, loader, trainer
from replay_models import images, resnet
from simulations import MIB, simulated, step

from lightning_vram import VramMonitor
from lightning_vram.advice.rules.base import no_reason
from lightning_vram.advice.rules.mixed_precision import NOT_ADVISED_OFF_CUDA
from lightning_vram.advice.rules.registry import RULES, advise, not_advised
from lightning_vram.records import Breakdown, Phase, Report, Simulation

DESIGN_IDS = frozenset(
    {
        "activation-checkpointing",
        "mixed-precision",
        "inplace-activations",
        "dataloader-workers",
        "pin-memory",
        "stale-gradients",
        "optimizer-state",
        "large-linear",
        "allocator-fragmentation",
        "batch-size-headroom",
        "near-capacity",
    }
)
"""The advice ids of the design's public contract."""
CUDA_ONLY = frozenset({"allocator-fragmentation", "batch-size-headroom", "near-capacity"})
"""Rules that read what only a CUDA device measures: its reserved memory, its capacity and its utilization."""
ON_THE_CPU = (DESIGN_IDS - CUDA_ONLY) | {"chunked-loss"}


def answered(report: Report) -> dict[str, str]:
    """Each rule id the report advised or did not, with its title or its reason."""
    found = {item.id.value: item.reason for item in report.not_advised}
    found.update({item.id.value: item.title for item in report.advice})
    return found


class CoinFlip(Classifier):
    """A step with a Python condition on a random tensor: the replay refuses it (its branch is the data's)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if torch.rand(()) < 0.5:
            loss = loss * 1.0
        return loss


def cpu_report(root: Path, module: Classifier) -> Report:
    """Four steps of a small ResNet on the CPU, attributed from step 1."""
    torch.manual_seed(0)
    monitor = VramMonitor(attribution_start_step=1, console_summary=False)
    trainer(root, [monitor], max_steps=4).fit(module, loader(images(32), 8))
    assert monitor.report is not None
    return monitor.report


@pytest.mark.replay
def test_a_step_the_replay_cannot_run_still_answers_every_rule(tmp_path: Path) -> None:
    report = cpu_report(tmp_path, CoinFlip(resnet()))
    assert report.simulation is not None and report.simulation.skipped is not None
    found = answered(report)
    assert found.keys() >= ON_THE_CPU, sorted(ON_THE_CPU - found.keys())
    assert found["chunked-loss"].startswith("not weighed by replay: the step was not replayed (")
    assert found["mixed-precision"] == NOT_ADVISED_OFF_CUDA


@pytest.mark.replay
def test_a_replayed_step_answers_every_rule(tmp_path: Path) -> None:
    report = cpu_report(tmp_path, Classifier(resnet()))
    assert report.simulation is not None and report.simulation.skipped is None
    found = answered(report)
    assert found.keys() >= ON_THE_CPU, sorted(ON_THE_CPU - found.keys())


def test_a_run_with_its_replays_off_answers_every_rule(tmp_path: Path) -> None:
    report = cpu_report(tmp_path, Classifier(resnet()))
    assert report.simulation is None
    found = answered(report)
    assert found.keys() >= ON_THE_CPU, sorted(ON_THE_CPU - found.keys())


def test_a_cuda_run_answers_every_rule_of_the_design() -> None:
    summary = healthy_summary(modules=blocks(4, 10 * MIB, 64 * MIB))
    for simulation in (None, simulated()):
        advice = advise(summary, healthy_setup(), simulation)
        found = {item.id.value for item in not_advised(summary, healthy_setup(), simulation, advice)}
        found |= {item.id.value for item in advice}
        assert DESIGN_IDS | {"chunked-loss"} <= found, sorted(DESIGN_IDS - found)


def test_a_loss_too_small_to_chunk_after_checkpointing_says_by_how_much() -> None:
    # The trial's BERT after checkpointing: the loss keeps half the forward pass's activations, but backward, with
    # the first gradients alive, peaks within 3 MiB of forward, and chunking leaves that backward as it is.
    forward = Breakdown(10 * MIB, 10 * MIB, 20 * MIB, 40 * MIB, 20 * MIB)
    backward = Breakdown(10 * MIB, 5 * MIB, 20 * MIB, 42 * MIB, 20 * MIB)
    baseline = step(
        100 * MIB,
        97 * MIB,
        50 * MIB,
        breakdowns={Phase.FORWARD: forward, Phase.BACKWARD: backward, Phase.OPTIMIZER: HEALTHY_BREAKDOWN},
        loss_bytes=20 * MIB,
        device="cpu",
    )
    simulation = simulated(baseline=baseline)
    summary = healthy_summary()
    advice = advise(summary, healthy_setup(), simulation)
    assert "chunked-loss" not in {item.id.value for item in advice}
    reasons = {item.id.value: item.reason for item in not_advised(summary, healthy_setup(), simulation, advice)}
    assert reasons["chunked-loss"] == (
        "the loss's own ops saved 20.0 MiB, 50.0% of the forward pass's activations and 20.0% of the replayed forward"
        " peak (100.0 MiB); modelled in 8 chunks, the step would peak at 97.0 MiB in backward, 3.0 MiB (3.0%) below"
        " the replayed peak: under the 5.0% of the peak the rule needs"
    )


def test_stale_gradients_unreplayed_say_their_modelled_saving() -> None:
    # The trial's ResNet whose step the replay refused: the peak in forward with the last step's gradients alive.
    at_forward = Breakdown(1536 * 1024, 1536 * 1024, 0, 20 * MIB, 8 * MIB)
    summary = healthy_summary(
        peak=peak(Phase.FORWARD, 40 * MIB, at_forward),
        phases={
            Phase.FORWARD: peak(Phase.FORWARD, 40 * MIB, at_forward),
            Phase.BACKWARD: peak(Phase.BACKWARD, 39 * MIB),
        },
    )
    refused = Simulation("cuda", None, None, "the step reads a tensor's value", (), 0.0)
    reasons = {item.id.value: item.reason for item in not_advised(summary, healthy_setup(), refused, ())}
    assert reasons["stale-gradients"] == (
        "not weighed by replay: the step was not replayed (the step reads a tensor's value); modelled, freeing the"
        " 1.5 MiB of gradients alive at the forward peak saves 1.0 MiB (2.5%): under the 5.0% of the peak the rule"
        " needs"
    )


def test_every_rule_of_the_registry_has_its_own_reason() -> None:
    assert [rule.id.value for rule in RULES if rule.why_not is no_reason] == []
