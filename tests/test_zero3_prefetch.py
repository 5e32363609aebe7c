"""ZeRO-3 at DeepSpeed's default ``stage3_prefetch_bucket_size`` on 2 gloo ranks, every parameter partitioned: each
rank's parts and phase peaks within 5% of its prediction from one process (the table is printed: run with -s).

Lightning's ``DeepSpeedStrategy`` sets no prefetch bucket, so DeepSpeed's 50,000,000 elements apply: one coalesced
all-gather fetches every parameter of a small model after the first module's, its flat buffer held beside the
parameters it splits out until the last of them is fetched (DeepSpeed 0.19: each parameter's entry in the
coordinator's in-flight registry references the group's handle, popped as its module is fetched). The model held
that buffer at the replay's forward peak wherever it came: the transformer LM of :mod:`zero_modules` (its peak at
the loss, after the head's fetch) was predicted 5,796,140 B where each rank measured 5,012,364 (+15.6%). Its
optimizer step was predicted 2,433,444 B where each rank measured 2,825,360 (-13.9%): ZeRO-3's step peak was fitted
with Adam, whose temporaries over a partition are one fewer than AdamW's (which scales the master partition first).
The ResNet under SGD, whose forward peaks before its head's fetch, held the buffer and was exact.

Backward's parts are printed, its peak checked, as tests/test_zero_module_optimizer.py has it: with these small
buckets the transformer's backward peak comes at its start (the loss's gradient, no reduce bucket yet), where the
model's parts are taken later.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from measured_again import measured_again_where_missed
from preloaded_python import run_script
from test_distributed import HANG, free_port
from test_rank_prediction_zero import SETTINGS
from test_zero_module_optimizer import WORLD, misses_of
from zero3_prefetch_train import PREFETCH
from zero_modules import MODULES, batch_of

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies.deepspeed import ZeroSettings, predict_zero
from lightning_vram.records import RankStep, StrategySpec

pytestmark = [pytest.mark.distributed, pytest.mark.replay]

RUN_SETTINGS = ZeroSettings(
    reduce_bucket_size=SETTINGS.reduce_bucket_size,
    allgather_bucket_size=SETTINGS.allgather_bucket_size,
    stage3_prefetch_bucket_size=PREFETCH,
)
"""The runs' ZeRO settings as the prediction reads them."""


def measured_ranks(out: Path) -> list[dict[str, Any]]:
    """Each rank's phases, by module, from one gloo run made in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = Path(__file__).parent / "zero3_prefetch_train.py"
    result = run_script(script, str(free_port()), str(out), timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_each_zero3_rank_within_five_percent_at_deepspeeds_prefetch_bucket(tmp_path: Path) -> None:
    steps: dict[str, list[RankStep]] = {}
    for name in MODULES:
        predictor = Predictor(MODULES[name](), None, batch_of(name), warm_up=True, gradients_at_forward=False)
        steps[name] = []
        for rank in range(WORLD):
            step = predict_zero(predictor, StrategySpec("deepspeed_stage_3", WORLD), None, RUN_SETTINGS, rank)
            assert isinstance(step, RankStep), step
            steps[name].append(step)

    def compared(ranks: list[dict[str, Any]]) -> list[str]:
        return [miss for name in MODULES for miss in misses_of(name, steps[name], ranks)]

    misses = measured_again_where_missed(tmp_path, measured_ranks, compared, lambda miss: miss.partition(":")[0])
    assert not misses, misses
