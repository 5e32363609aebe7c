"""One rank predicted from one process against each gloo rank's measured step, at world sizes 2 and 4.

Each configuration trains two steps on the CPU (tests/rank_prediction_train.py), the monitor counting each rank's
second step (its counted parts and the live peak of every phase). In this process, with no process group, the same
module and one rank's batch are predicted by ``predict_rank`` for that world size: DDP as the replay holding its
buckets, FSDP2 as torch's ``fully_shard`` replayed under a fake process group. Every part and live peak of every
phase of every rank must be within 5% (the table is printed: run with -s).
"""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path

import pytest
from measured_again import measured_again_where_missed
from preloaded_python import run_script
from rank_prediction_train import model_named, one_batch
from replay_records import peak_error

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.records import RankStep, StrategySpec

HANG = 900
"""Seconds a run may take: far more than a loaded 2-core machine needs, so only a hang reaches it."""
TOLERANCE = 0.05
MISS_KEY = operator.itemgetter(0, 1, 2)
"""Which figure a miss ``(rank, phase, part, measured, predicted)`` is of."""
# Every part and live peak within 5%. Now and then one rank holds a collective's tensors more while the optimizer
# steps: the root group's 264,704-byte reduce-scatter input, freed late by gloo's worker thread (FSDP2 x4 under
# accumulation: 1,723,000 bytes for 1,458,288 once; FSDP2 x2: 2,515,576 for 2,250,864 in both runs of a fresh-clone
# suite, and 1 rank in 32 under load here, released late of that peak to the byte; docs/measurement.md). Each rank
# records what was released late of each live peak (rank_prediction_train.py), and the live peak is held to the
# range the step without that delay peaked in; what else varies is measured again (``measured_again.py``).
# Gloo reduce-scatters by cloning the whole input, all-reducing the clone and copying this rank's chunk out; NCCL
# has no such copy and the replay's fake group none either (the wide head's root reduce-scatter at backward's peak:
# 1,579,844 bytes measured for 1,436,480 predicted, -9.1%; 1,436,484 without the 270,336-byte clone;
# docs/measurement.md). The live peak is held to each rank's peak less gloo's clones alive at each instant
# (tests/gloo_clones.py), and only those: every other figure as measured.
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "live peak")

pytestmark = [pytest.mark.distributed, pytest.mark.replay]


def measured(
    out: Path, world_size: int, strategy: str, model: str, accumulate: int = 1, sampled: int | None = None
) -> list[dict[str, dict[str, int]]]:
    """Each rank's phases as its monitor measured them (``{phase: {part: bytes}}``), on micro-batch ``sampled``."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    script = Path(__file__).parent / "rank_prediction_train.py"
    micro_batch = str(2 * accumulate - 1 if sampled is None else sampled)
    arguments = (str(out), str(world_size), strategy, model, str(accumulate), micro_batch)
    result = run_script(script, *arguments, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def predicted(
    world_size: int, strategy: str, model: str, accumulate: int = 1, first: bool = False
) -> dict[str, dict[str, int]]:
    """One rank's phases predicted in this process (``{phase: {part: bytes}}``): under accumulation the steady
    micro-batch's, or with ``first`` the window's first."""
    predictor = Predictor(model_named(model), None, one_batch(model), warm_up=True, accumulate=accumulate)
    rank = predict_rank(predictor, StrategySpec(strategy, world_size))
    assert isinstance(rank, RankStep), rank
    assert (rank.window_first is None) == (accumulate == 1)
    chosen = rank.window_first if first else rank.phases
    assert chosen is not None
    phases = {}
    for phase, peak in chosen.items():
        b = peak.breakdown
        assert b is not None
        phases[phase.value] = {
            "parameters": b.parameters,
            "gradients": b.gradients,
            "optimizer_state": b.optimizer_state,
            "activations": b.activations,
            "live peak": peak.peak_bytes,
        }
    return phases


@pytest.mark.parametrize(
    ("strategy", "world_size", "model"),
    [
        ("ddp", 2, "gpt"),
        ("ddp", 4, "gpt"),
        ("fsdp2", 2, "gpt"),
        ("fsdp2", 4, "gpt"),
        ("ddp", 2, "cnn"),
        ("fsdp2", 2, "cnn"),
        ("fsdp2", 2, "blocks"),
        ("fsdp2", 2, "resnet"),
        ("fsdp2", 2, "head"),
    ],
)
def test_each_rank_is_within_5_percent_of_the_one_process_prediction(
    tmp_path: Path, strategy: str, world_size: int, model: str
) -> None:
    prediction = predicted(world_size, strategy, model)
    assert prediction.keys() == {"forward", "backward", "optimizer"}
    title = f"{strategy} x{world_size} on gloo, {model}"
    measure = lambda out: measured(out, world_size, strategy, model)  # noqa: E731
    misses = measured_again_where_missed(tmp_path, measure, lambda ranks: compare(ranks, prediction, title), MISS_KEY)
    assert misses == []


@pytest.mark.parametrize(
    ("strategy", "world_size", "place"),
    [
        ("ddp", 2, "steady"),
        ("ddp", 4, "steady"),
        ("ddp", 2, "first"),
        ("fsdp2", 2, "steady"),
        ("fsdp2", 4, "steady"),
        ("fsdp2", 2, "first"),
    ],
)
def test_each_rank_under_accumulation_is_within_5_percent_of_the_one_process_prediction(
    tmp_path: Path, strategy: str, world_size: int, place: str
) -> None:
    """accumulate_grad_batches=2, two windows: the second window's first micro-batch (step 2) or its last (step 3,
    with the optimizer step) measured on each rank, against ``predict_rank``'s ``window_first`` or ``phases``."""
    first = place == "first"
    title = f"{strategy} x{world_size} on gloo, gpt, accumulate_grad_batches=2, {place} micro-batch"
    prediction = predicted(world_size, strategy, "gpt", 2, first)
    assert prediction.keys() == ({"forward", "backward"} if first else {"forward", "backward", "optimizer"})
    measure = lambda out: measured(out, world_size, strategy, "gpt", 2, 2 if first else 3)  # noqa: E731
    misses = measured_again_where_missed(tmp_path, measure, lambda ranks: compare(ranks, prediction, title), MISS_KEY)
    assert misses == []


def compare(
    ranks: list[dict[str, dict[str, int]]],
    prediction: dict[str, dict[str, int]],
    title: str,
) -> list[tuple[int, str, str, int, int]]:
    """Every rank's every part and live peak of every phase against the prediction: the misses past 5%; the table
    printed. The live peak is measured without gloo's reduce-scatter clones (``gloo_clones.py``; the measured peak
    with them in brackets where they differ); a predicted live peak between it with and without what gloo's worker
    thread released late of it is on it (``peak_error``)."""
    print(f"\n{title}: each rank measured, one rank predicted in one process (bytes)")
    print(f"{'rank':>4} {'phase':<9} {'part':<15} {'measured':>10} {'predicted':>10} {'error':>8} released late")
    failures = []
    for rank, phases in enumerate(ranks):
        assert phases.keys() == prediction.keys()
        for phase, parts in phases.items():
            late = {phase: parts["released late"]}
            for part in PARTS:
                value, guess = parts[part], prediction[phase][part]
                if part == "live peak":
                    value = parts["without gloo's clones"]
                    error = peak_error(phase, value, guess, late)
                else:
                    error = abs(guess - value) / value if value else float(guess != 0)
                released = f" {late[phase]}" if part == "live peak" and late[phase] else ""
                if part == "live peak" and value != parts[part]:
                    released += f" (with gloo's clones {parts[part]})"
                print(f"{rank:>4} {phase:<9} {part:<15} {value:>10} {guess:>10} {error:>8.4%}{released}")
                if error > TOLERANCE:
                    failures.append((rank, phase, part, value, guess))
    return failures
