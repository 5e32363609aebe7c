"""What every strategy's rank prediction shares: the single-device step as a :class:`RankStep`, phases with lines."""

from __future__ import annotations

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import RankStep, ReplaySkipped, StepChange, StrategySpec

SINGLE_METHOD = "replayed: the single-process step, as it is"
"""How a single-device rank is predicted."""


def single(predictor: Predictor, spec: StrategySpec, change: StepChange | None) -> RankStep | ReplaySkipped:
    """The predictor's own replay as one rank's step: no strategy, nothing sent."""
    replayed = predictor.replay(change)
    if isinstance(replayed, ReplaySkipped):
        return replayed
    return RankStep(spec, replayed.phases, (), 0, SINGLE_METHOD, replayed.notes, replayed)
