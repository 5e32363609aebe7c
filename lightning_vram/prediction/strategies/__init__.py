"""One rank of a multi-GPU strategy predicted from one process, at any world size (:func:`predict_rank`).

Each strategy has its own module, registered in :data:`PREDICTORS` by its :class:`StrategySpec` name (``ddp``:
the single-process replay with DDP's buckets, by torch's arithmetic; ``fsdp2``: torch's ``fully_shard`` replayed
under a fake process group). A name not registered is answered with a
:class:`ReplaySkipped` saying so.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import ddp, deepspeed, fsdp1, fsdp2
from lightning_vram.prediction.strategies.common import single
from lightning_vram.records import RankStep, ReplaySkipped, StepChange, StrategySpec

RankPredictor = Callable[[Predictor, StrategySpec, StepChange | None], RankStep | ReplaySkipped]
"""A strategy's prediction of one rank: the round's predictor, the spec, the change to the step (or ``None``)."""

PREDICTORS: dict[str, RankPredictor] = {
    "single": single,
    "ddp": ddp.predict,
    "fsdp2": fsdp2.predict,
    "fsdp": fsdp1.predict,
    "deepspeed_stage_1": deepspeed.predict,
    "deepspeed_stage_2": deepspeed.predict,
    "deepspeed_stage_3": deepspeed.predict,
}
"""Each modelled strategy's prediction, by :attr:`StrategySpec.name`; another strategy's module adds itself here."""


def predict_rank(
    predictor: Predictor, spec: StrategySpec, change: StepChange | None = None
) -> RankStep | ReplaySkipped:
    """One rank's step under ``spec``, from this one process: the predictor's step as one of ``spec``'s ranks.

    The predictor's batch is one rank's batch. ``change``: the step's change (``None``: as it is). A strategy that is
    not modelled, or a step that cannot be replayed, gives a :class:`ReplaySkipped` saying why.
    """
    predict = PREDICTORS.get(spec.name)
    if predict is None:
        return ReplaySkipped(f"{spec.name}: not modelled yet")
    return predict(predictor, spec, change)
