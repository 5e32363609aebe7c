"""DeepSpeed ZeRO 1-3 and FSDP1 per rank, predicted from one process, against gloo runs at world sizes 2 and 4.

tests/zero_fsdp1_ranks.py trains a small transformer under each strategy on WORLD CPU processes, each rank measured
by VramSession; here one process predicts each rank (``predict_rank``'s arithmetic on the single-process replay)
and every part of every phase is compared with the rank's report, printed as a table (``pytest -s``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from measured_again import measured_again_where_missed
from preloaded_python import run_script
from replay_records import peak_error
from test_distributed import HANG, free_port
from zero_fsdp1_ranks import BATCH_SHAPE, STRATEGIES, ZERO_SETTINGS, transformer

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.prediction.strategies.deepspeed import ZeroSettings, crossing_bytes, predict_zero
from lightning_vram.prediction.strategies.fsdp1 import predict_units, unit_numels
from lightning_vram.records import Phase, RankStep, ReplaySkipped, StrategySpec

pytestmark = [pytest.mark.distributed, pytest.mark.replay]

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "peak")
TOLERANCE = 0.05
"""The issue's bound: each part of each phase within 5% of the measured one."""
# Every part of every phase within 5%, ZeRO-1/2's backward peak predicted rank by rank (``_zero_buckets``: each
# rank's ``grads_in_partition`` from the first reduce that reaches its partition; once 15%). A rank now and then
# holds a collective's tensors more at a peak, freed late by gloo's thread (ZeRO-2's optimizer peak under
# accumulation: 697,008 bytes for 624,800 once on the CI machine; docs/measurement.md): each rank records what was
# released late of each peak (tests/late_releases.py), a predicted peak in the range the step peaked in without that
# delay is on it; what else varies is measured again (``measured_again.py``), each figure within 5% in one of two
# runs. FSDP1's activations are the single-process replay's: the count leaves the gathered flat parameters autograd
# saves views of, which FSDP1 frees by resize_(0) after forward, out of them (lightning_vram/measure/fsdp1.py), the
# same figure every run.
SETTINGS = ZeroSettings(
    reduce_bucket_size=ZERO_SETTINGS["reduce_bucket_size"],
    allgather_bucket_size=ZERO_SETTINGS["allgather_bucket_size"],
    stage3_prefetch_bucket_size=ZERO_SETTINGS["stage3_prefetch_bucket_size"],
)


def miss_key(miss: str) -> str:
    """Which figure a miss (``"deepspeed_stage_1 rank 2 backward peak: 999420 vs 1114012 (-10.3%)"``) is of."""
    return miss.partition(":")[0]


def loss_of(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The runs' loss: the output's mean square."""
    return module(batch).square().mean()


def predictor_of(accumulate: int) -> Predictor:
    """One process's replay of one rank's step (the runs free the gradients before the next forward)."""
    torch.manual_seed(0)
    module = transformer()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    batch = torch.randn(*BATCH_SHAPE)
    return Predictor(
        module,
        [optimizer],
        batch,
        step_function=loss_of,
        warm_up=True,
        gradients_at_forward=False,
        accumulate=accumulate,
    )


@pytest.fixture(scope="module")
def predictor() -> Predictor:
    """One process's replay of one rank's step, without accumulation."""
    return predictor_of(1)


def measured_ranks(tmp_path: Path, world: int, accumulate: int = 1) -> list[dict[str, Any]]:
    """Each rank's report phases, by strategy, from a gloo run of ``world`` processes (``accumulate`` micro-batches
    per optimizer step, the last sampled)."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script = Path(__file__).parent / "zero_fsdp1_ranks.py"
    arguments = (str(world), str(free_port()), str(tmp_path), str(accumulate))
    result = run_script(script, *arguments, timeout=HANG, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


def predicted(predictor: Predictor, name: str, world: int, rank: int) -> RankStep:
    """Rank ``rank`` of ``name`` at ``world``, as the runs set it up."""
    strategy, _, sharding = name.partition(" ")
    spec = StrategySpec(strategy, world_size=world, sharding=sharding or None)
    if strategy == "fsdp":
        step = predict_units(predictor, spec, None, (torch.nn.TransformerEncoderLayer,))
    else:
        step = predict_zero(predictor, spec, None, SETTINGS, rank)
    assert isinstance(step, RankStep), step
    return step


def figures(step: RankStep, phase: Phase) -> dict[str, int]:
    """One phase's predicted parts and peak."""
    peak = step.phases[phase]
    assert peak.breakdown is not None
    return {**{part: getattr(peak.breakdown, part) for part in PARTS[:-1]}, "peak": peak.peak_bytes}


def predictions(predictor: Predictor, world: int) -> dict[tuple[str, int], RankStep]:
    """Each strategy's prediction for each rank of ``world``: made once, for the run and for a run measured again
    (each prediction replays the step). FSDP1's takes no rank (``predict_units``: every rank's share is the same),
    so one serves every rank."""
    steps: dict[tuple[str, int], RankStep] = {}
    for name in STRATEGIES:
        for rank in range(world):
            same = name.startswith("fsdp") and rank > 0
            steps[name, rank] = steps[name, 0] if same else predicted(predictor, name, world, rank)
    return steps


def compare(
    predictor: Predictor, steps: dict[tuple[str, int], RankStep], world: int, ranks: list[dict[str, Any]]
) -> list[str]:
    """Every part of every phase, predicted (``steps``, :func:`predictions`) against measured, rank by rank: the
    table's lines and the misses."""
    window = f", accumulate {predictor.accumulate} (the steady micro-batch)" if predictor.accumulate > 1 else ""
    print(f"\nworld size {world}{window}: predicted / measured bytes (error)")
    misses = []
    for name in STRATEGIES:
        for rank, record in enumerate(ranks):
            step = steps[name, rank]
            for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
                measured = record[name][phase.value]
                cells = []
                for part, guess in figures(step, phase).items():
                    actual = measured[part]
                    error = (guess - actual) / actual if actual else float(guess != 0)
                    late = measured["released late"]
                    if part == "peak" and late:  # within the range the step peaked in without gloo's delay: on it
                        error = math.copysign(peak_error(phase.value, actual, guess, {phase.value: late}), error)
                        cells.append(f"{part} {guess}/{actual} ({error:+.1%}, {late} released late)")
                    else:
                        cells.append(f"{part} {guess}/{actual} ({error:+.1%})")
                    if abs(error) > TOLERANCE:
                        misses.append(f"{name} rank {rank} {phase.value} {part}: {guess} vs {actual} ({error:+.1%})")
                print(f"{name:18} r{rank} {phase.value:9} " + "  ".join(cells))
    return misses


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_within_five_percent_of_gloo(tmp_path: Path, predictor: Predictor, world: int) -> None:
    measure = lambda out: measured_ranks(out, world)  # noqa: E731
    steps = predictions(predictor, world)
    compared = lambda ranks: compare(predictor, steps, world, ranks)  # noqa: E731
    misses = measured_again_where_missed(tmp_path, measure, compared, miss_key)
    assert misses == []


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_under_accumulation_within_five_percent_of_gloo(tmp_path: Path, world: int) -> None:
    # gradient_accumulation_steps=2 (DeepSpeed) and no_sync() on the window's first micro-batch (FSDP1), the last
    # micro-batch of the second window measured: ZeRO-1 holds every whole gradient across the window, FSDP1's
    # FULL_SHARD and SHARD_GRAD_OP every unit's unsharded one; ZeRO-2, ZeRO-3 and NO_SHARD what they hold without.
    accumulating = predictor_of(2)
    measure = lambda out: measured_ranks(out, world, 2)  # noqa: E731
    steps = predictions(accumulating, world)
    compared = lambda ranks: compare(accumulating, steps, world, ranks)  # noqa: E731
    misses = measured_again_where_missed(tmp_path, measure, compared, miss_key)
    assert misses == []


def test_accumulation_sends_what_each_strategy_sends_per_micro_batch(predictor: Predictor) -> None:
    # Two micro-batches a window at world size 4, against one: ZeRO-3 gathers twice and reduce-scatters every
    # micro-batch (twice the bytes); ZeRO-2 reduce-scatters each (one more, 3/4 of the 270,400-byte flat buffer);
    # ZeRO-1 and FSDP1's NO_SHARD reduce once a window; FSDP1 FULL_SHARD gathers twice each micro-batch, reduces once.
    accumulating = predictor_of(2)
    sent = {}
    for name in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp", "fsdp NO_SHARD"):
        once, window = predicted(predictor, name, 4, 0), predicted(accumulating, name, 4, 0)
        sent[name] = window.communication_bytes - once.communication_bytes
        assert window.window_first is None and once.window_first is None
        assert "does not predict the window's first micro-batch" in window.notes[-1]
        assert window.micro_batch.startswith("steady") and once.micro_batch == "the step"
    whole = 4 * 67_594
    assert sent == {
        "deepspeed_stage_1": 0,
        "deepspeed_stage_2": 3 * 270_400 // 4,
        "deepspeed_stage_3": 3 * 3 * whole // 4,
        "fsdp": 2 * 3 * 4 * (2 * 33_472 + 652) // 4,
        "fsdp NO_SHARD": 0,
    }


def test_lightning_defaults_at_1024_ranks(predictor: Predictor) -> None:
    # The registry's figures for one rank of 1,024 under Lightning's DeepSpeedStrategy defaults (2e8-element
    # buckets) and FSDPStrategy without a wrap policy (the root the only unit), and the bytes each rank sends.
    world, numel = 1024, 67_594
    stage2 = predict_rank(predictor, StrategySpec("deepspeed_stage_2", world_size=world))
    stage3 = predict_rank(predictor, StrategySpec("deepspeed_stage_3", world_size=world))
    fsdp = predict_rank(predictor, StrategySpec("fsdp", world_size=world, sharding="FULL_SHARD"))
    assert isinstance(stage2, RankStep) and isinstance(stage3, RankStep) and isinstance(fsdp, RankStep)
    flat = 69_632  # 67,594 padded to a multiple of 2 x 1,024
    forward = stage2.phases[Phase.FORWARD].breakdown
    assert forward is not None and forward.parameters == 4 * flat
    assert forward.optimizer_state == 3 * 4 * (flat // world) + 4  # fp32 master, Adam's two moments, a step
    backward = stage2.phases[Phase.BACKWARD].breakdown
    assert backward is not None and backward.gradients == 4 * 200_000_000  # one reduce bucket
    assert stage2.communication_bytes == 2 * (world - 1) * 4 * flat // world  # reduce-scatter, all-gather
    assert stage3.communication_bytes == 3 * (world - 1) * 4 * numel // world  # two all-gathers, reduce-scatter
    assert unit_numels(predictor.module, ()) == [numel]
    fsdp_forward = fsdp.phases[Phase.FORWARD].breakdown
    assert fsdp_forward is not None and fsdp_forward.parameters == 4 * 67  # 68,608 (67,594 padded) / 1,024
    assert fsdp.communication_bytes == 3 * (world - 1) * 4 * 68_608 // world
    assert "refuses fake tensors" in stage2.method and "fake process group" in fsdp.method
    hybrid = predict_rank(predictor, StrategySpec("fsdp", world_size=world, sharding="HYBRID_SHARD"))
    assert not isinstance(hybrid, RankStep) and "HYBRID_SHARD with offload=False is not modelled yet" in hybrid.reason
    unsharded = predict_rank(predictor, StrategySpec("fsdp", world_size=world, sharding="NO_SHARD"))
    assert isinstance(unsharded, RankStep)
    assert unsharded.communication_bytes == 2 * (world - 1) * 4 * numel // world  # the gradients all-reduced
    grad_op = predict_rank(predictor, StrategySpec("fsdp", world_size=world, sharding="SHARD_GRAD_OP"))
    assert isinstance(grad_op, RankStep)
    assert grad_op.communication_bytes == 2 * (world - 1) * 4 * 68_608 // world  # one all-gather, reduce-scatter
    serial = predict_zero(
        predictor, StrategySpec("deepspeed_stage_1", world_size=2), None, ZeroSettings(overlap_comm=False)
    )
    assert not isinstance(serial, RankStep) and "without overlap_comm" in serial.reason


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_rank_holds_its_partition_buffer_from_its_first_bucket_reduce(accumulate: int) -> None:
    # World size 4, the runs' settings: ranks 2 and 3 hold their grads_in_partition (99,328 and 69,928 bytes) from
    # the first bucket reduce on, at backward's peak; ranks 0 and 1 allocate theirs after it. The gloo runs measured
    # 979,060, 979,060, 1,043,828 and 1,014,428 bytes under ZeRO-1 and ZeRO-2, with and without accumulation, but for
    # ZeRO-1 accumulating, which holds every whole gradient until its hook: 1,166,324, 1,166,324, 1,227,636 and
    # 1,198,236. Before this model every rank was predicted the same (999,420; 964,980 and 1,235,356 accumulating).
    predictor = predictor_of(accumulate)
    expected = {
        "deepspeed_stage_2": [979_052, 979_052, 1_043_820, 1_014_420],
        "deepspeed_stage_1": [979_052, 979_052, 1_043_820, 1_014_420],
    }
    if accumulate == 2:
        expected = {
            "deepspeed_stage_2": [979_056, 979_056, 1_043_824, 1_014_424],
            "deepspeed_stage_1": [1_166_320, 1_166_320, 1_227_632, 1_198_232],
        }
    peaks = {
        name: [predicted(predictor, name, 4, rank).phases[Phase.BACKWARD].peak_bytes for rank in range(4)]
        for name in expected
    }
    assert peaks == expected
    most = predict_zero(predictor, StrategySpec("deepspeed_stage_2", world_size=4), None, SETTINGS)
    assert isinstance(most, RankStep) and most.phases[Phase.BACKWARD].peak_bytes == max(expected["deepspeed_stage_2"])


def test_crossing_parameters_keep_their_whole_gradient() -> None:
    # The transformer's parameters at world size 4 (ZeRO-1/2 partitions of 16,900 elements): rank 1's partition
    # starts inside layer 0's linear1.weight (8,192 elements, 260 of them on rank 0) and ends inside layer 1's
    # in_proj_weight (12,288 elements, 11,960 past the edge).
    numels = [parameter.numel() for parameter in transformer().parameters()]
    assert crossing_bytes(numels, 16_900, 33_800, 4) == 4 * (260 + 11_960)
    assert crossing_bytes(numels, 0, 16_900, 4) == 4 * (8_192 - 260)


def test_offload_moves_the_state_and_gradient_partition_to_the_host(predictor: Predictor) -> None:
    # ZeRO-2 at world size 4 with the runs' settings: what the gloo run counted on the device for the state (202,804)
    # and rank 1's gradients at the step (116,480, the rank holding the most) become host lines; the device keeps
    # the parameters, backward's bucket and the activations.
    spec = StrategySpec("deepspeed_stage_2", world_size=4, offload=True)
    step = predict_zero(predictor, spec, None, SETTINGS)
    assert isinstance(step, RankStep)
    assert [(line.bytes, line.on_host) for line in step.lines if line.on_host] == [(202_804, True), (116_480, True)]
    assert step.host_bytes == 202_804 + 116_480
    for phase, peak in step.phases.items():
        assert peak.breakdown is not None and peak.breakdown.optimizer_state == 0
        assert peak.breakdown.parameters == 4 * 67_600
        assert peak.breakdown.gradients == (80_000 if phase is Phase.BACKWARD else 0)
    assert step.phases[Phase.OPTIMIZER].peak_bytes == 4 * 67_600 + 4 * 4 * 16 * 64  # the parameters, the batch
    assert "ZeRO-Offload" in step.method


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1_offload_moves_the_shards_their_gradients_and_the_state_to_the_host(
    predictor: Predictor, sharding: str
) -> None:
    """FSDP1's CPUOffload(offload_params=True) by arithmetic: the rank without offload, its shards, their gradients
    (_cpu_grad) and the state as host lines; the device keeps the unsharded unit (in activations, as autograd saves
    it) and backward's reduce-scatter output; the optimizer steps on the host (the device holds the batch)."""
    kept = predict_rank(predictor, StrategySpec("fsdp", world_size=4, sharding=sharding))
    step = predict_rank(predictor, StrategySpec("fsdp", world_size=4, sharding=sharding, offload=True))
    assert isinstance(step, RankStep) and isinstance(kept, RankStep), step
    shard = 4 * 67_596 // 4  # the root's one flat parameter, 67,594 elements padded to 4, one rank's quarter
    stepped = kept.phases[Phase.OPTIMIZER].breakdown
    assert stepped is not None and stepped.parameters == stepped.gradients == shard
    host = [(line.label, line.bytes) for line in step.lines if line.on_host]
    assert host == [
        ("FSDP1 offloaded flat parameter shards (host)", shard),
        ("FSDP1 offloaded gradient shards, _cpu_grad (host)", shard),
        ("FSDP1 offloaded optimizer state (host)", stepped.optimizer_state),
    ]
    assert stepped.optimizer_state == 2 * shard + 4  # Adam's two moments and a step, over the one flat shard
    (copied,) = [line for line in step.lines if line.label == "FSDP1 shard copied to the device (largest)"]
    assert copied.bytes == shard and not copied.on_host
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        device, whole = step.phases[phase].breakdown, kept.phases[phase].breakdown
        assert device is not None and whole is not None
        assert (device.parameters, device.gradients, device.optimizer_state) == (0, 0, 0)
        assert device.activations == whole.activations  # the unsharded unit among them
        # on the CPU the copy to the device is the shard itself: the device holds the rest of the peak
        assert step.phases[phase].peak_bytes == kept.phases[phase].peak_bytes - whole.counted_bytes + whole.activations
    assert step.phases[Phase.OPTIMIZER].peak_bytes == 4 * 4 * 16 * 64  # the batch
    assert "CPUOffload(offload_params=True)" in step.method
    unsharded = predict_rank(predictor, StrategySpec("fsdp", world_size=4, sharding="NO_SHARD", offload=True))
    assert unsharded == ReplaySkipped(
        "fsdp x4 NO_SHARD offload: FSDP1's NO_SHARD with offload=True is not modelled yet"
    )


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor is deprecated:UserWarning")
def test_fsdp1_steps_under_the_fake_process_group_with_fake_tensors() -> None:
    # What fsdp1.py's docstring says of torch 2.13: one rank of 4 wraps the transformer (its layers as units) and
    # trains a step with fake tensors and no other process; each unit's flat parameter is this rank's quarter.
    # FSDP1 reads a fake tensor's data pointer on the way (torch warns it will become an error).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            wrapped = FullyShardedDataParallel(
                transformer(),
                auto_wrap_policy=ModuleWrapPolicy({torch.nn.TransformerEncoderLayer}),
                device_id=torch.device("cpu"),
                use_orig_params=False,
            )
            optimizer = torch.optim.Adam(wrapped.parameters())
            loss_of(wrapped, torch.randn(*BATCH_SHAPE)).backward()
            optimizer.step()
            assert sorted(parameter.numel() for parameter in wrapped.parameters()) == [163, 8_368, 8_368]
    finally:
        torch.distributed.destroy_process_group()
