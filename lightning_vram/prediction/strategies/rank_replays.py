"""One rank of a live sharded run, replayed as the per-rank model predicts it: what the simulation asks of it.

:class:`RankReplays` answers :class:`~lightning_vram.prediction.replay.simulation.Replays` with this rank's step by
:func:`~lightning_vram.prediction.strategies.predict_rank`'s figures, so the run's sampled step is checked against
the rank's prediction (its baseline) and each change's saving is the rank's. Every replay underneath is the
single-process one of the predictor's unsharded module: no collective of the run's, no process group of its (an
FSDP2 rank's replay shards its copy over fake groups of its own:
:mod:`~lightning_vram.prediction.strategies.fsdp2`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from lightning_vram.prediction.allocator.settings import AllocatorSettings
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import fsdp1, fsdp2
from lightning_vram.prediction.strategies.deepspeed import ZeroSettings, predict_zero
from lightning_vram.records import (
    Attribution,
    Calibration,
    Phase,
    PhasePeak,
    RankStep,
    ReplayedStep,
    ReplaySkipped,
    StepChange,
    StrategySpec,
)

RANK_TOLERANCE = 0.05
"""How far each part of the rank's prediction may be from the sampled step's count for its advice to be trusted: the
per-rank model's bound (issue 26; tests/test_rank_prediction_zero.py), not the single-process replay's 1%."""


class RankReplays:
    """One rank's steps under ``spec``, each the predictor's single-process replay through the strategy's model.

    Args:
        predictor: the round's predictor, on the unsharded module (the whole parameters) and one rank's batch.
        spec: the run's strategy and world size.
        settings: ZeRO's bucket settings, read from the run.
        rank: this rank (ZeRO-1/2's gradients crossing its partition's edges differ by rank).
        units: an FSDP2 run's units as it sharded them (``spec`` is ``fsdp2``): the step is replayed sharded again
            that way (:func:`~lightning_vram.prediction.strategies.fsdp2.predict`); an FSDP1 run's flat parameters
            (``spec`` is ``fsdp``): the unsharded step sized by them
            (:func:`~lightning_vram.prediction.strategies.fsdp1.predict_live`); ``None`` for ZeRO.
    """

    def __init__(
        self,
        predictor: Predictor,
        spec: StrategySpec,
        settings: ZeroSettings,
        rank: int,
        units: fsdp2.LiveUnits | fsdp1.LiveFlats | None = None,
    ) -> None:
        self.predictor, self.spec, self.settings, self.rank, self.units = predictor, spec, settings, rank, units
        self.batch: Any = predictor.batch
        """The rank's batch."""
        self.budget_seconds: float | None = predictor.budget_seconds
        """The predictor's budget, in host seconds."""
        self.calibration: Attribution | None = predictor.calibration
        """The sampled step's counts on this rank."""
        self.released_late: Callable[[], Mapping[Phase, int]] = predictor.released_late
        """Of each of this rank's sampled live peaks, the bytes gloo's thread freed late (the predictor's)."""
        self.clock: Callable[[], float] = predictor.clock
        """The predictor's clock, in seconds."""
        self.started: float = predictor.started
        """When the budget started, on :attr:`clock`."""
        self.measured: Mapping[Phase, PhasePeak] | None = None
        """No allocator peaks are carried into a rank's prediction (its figures are the strategy's arithmetic)."""
        self.allocator: AllocatorSettings | None = None
        """No allocator model runs on a rank's prediction (the arithmetic keeps no allocation sequence)."""
        self.carried: Calibration | None = None
        """Set by the simulation; never carried into the rank's figures (no allocator peaks on this path)."""

    @property
    def device_type(self) -> str:
        """The counted device's type."""
        return self.predictor.device_type

    @property
    def accumulate(self) -> int:
        """``accumulate_grad_batches``, as the rank's predictor replays it."""
        return self.predictor.accumulate

    def seconds_left(self) -> float | None:
        """Host seconds left of the budget."""
        return self.predictor.seconds_left()

    def out_of_time(self) -> bool:
        """Whether the budget has run out."""
        return self.predictor.out_of_time()

    def replay(self, change: StepChange | None = None, count_flops: bool = False) -> ReplayedStep | ReplaySkipped:
        """The rank's step with ``change``, as a replayed step whose phases are the rank's prediction.

        ``count_flops`` is not honoured: the strategy's model replays without counting FLOPs.
        """
        if isinstance(self.units, fsdp2.LiveUnits):
            predicted = fsdp2.predict(self.predictor, self.spec, change, self.units)
        elif isinstance(self.units, fsdp1.LiveFlats):
            predicted = fsdp1.predict_live(self.predictor, self.spec, change, self.units)
        else:
            predicted = predict_zero(self.predictor, self.spec, change, self.settings, self.rank)
        if isinstance(predicted, ReplaySkipped):
            return predicted
        return as_replayed(predicted)

    def reserved_with(self, settings: AllocatorSettings, steps_before: int | None = None) -> dict[Phase, int] | None:
        """No allocation sequence is kept for a rank's prediction."""
        return None


def as_replayed(predicted: RankStep) -> ReplayedStep:
    """The rank's prediction as a replayed step: the single-process replay with the rank's phases and method noted.

    On the CPU the host is the device: an FSDP2 rank offloading to the CPU holds its device phases and its host
    lines in one memory, which are the phases its sharded replay counted (:func:`fsdp2.offloaded` takes the host
    lines out of them and nothing else), and what the run's own count of the step measures.
    """
    replayed = predicted.replayed
    assert replayed is not None
    note = f"{predicted.spec.label}: {predicted.method}"
    one_memory = predicted.spec.name == "fsdp2" and predicted.spec.offload and replayed.device_type == "cpu"
    phases = replayed.phases if one_memory else predicted.phases
    return replace(replayed, phases=phases, timeline=None, allocations=None, notes=(*predicted.notes, note))
