"""The ``offload-optimizer`` rule on scripted trials, the trial's JSON, and the trial from one process's replay.

The rule reads :attr:`Simulation.offload` (a live ZeRO-1/2/3 or FSDP2 rank that does not offload, near the CUDA
device's capacity, predicted with CPU offload by the per-rank model from the same replay), the way
tests/test_sharding_stage.py drives ``sharding-stage``: CUDA runs described by their summary, no GPU needed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from advice_summaries import CPU, GIB, MIB, healthy_setup, healthy_summary, peak
from models import OPTIMIZERS, Classifier
from test_rank_prediction_zero import SETTINGS, predictor_of
from test_sharding_stage import TRIAL, simulation_with
from torch import nn

from lightning_vram.advice.rules.offload_optimizer import offload_optimizer, strategy_code, wants_offload_trial
from lightning_vram.advice.rules.registry import advise, not_advised
from lightning_vram.advice.trials import try_rank_changes
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import fsdp2
from lightning_vram.prediction.strategies.deepspeed import predict_zero
from lightning_vram.prediction.strategies.live import LiveSharding, live_sharding
from lightning_vram.prediction.strategies.offloading import offload_trial
from lightning_vram.prediction.strategies.rank_replays import RankReplays
from lightning_vram.prediction.strategies.stronger import small_parameter_bytes
from lightning_vram.records import OffloadTrial, Phase, RankStep, SavingBasis, StrategySpec, TrainingLoop
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict

OFFLOAD = OffloadTrial(
    strategy="deepspeed_stage_2",
    world_size=8,
    current_peak_bytes=15 * GIB,
    target_peak_bytes=10 * GIB,
    target_phase=Phase.BACKWARD,
    host_bytes=6 * GIB,
    transfer_bytes=3_150_000_000,
    method="arithmetic on the single-process replay (stage 2); ZeRO-Offload",
    reduce_bucket_size=200_000_000,
    allgather_bucket_size=200_000_000,
    measured_peak_bytes=15 * GIB,
)
"""ZeRO-2 on 8 ranks measured at 15 GiB of a 16 GiB GPU, predicted at 10 GiB with ZeRO-Offload."""
NEAR = healthy_summary(peak=peak(Phase.BACKWARD, 15 * GIB))
"""A CUDA run at 15 GiB of 16 (93.75%: near capacity)."""


def offloading(trial: OffloadTrial | None, sharding: object = None) -> object:
    """A trusted simulation carrying ``trial`` (and ``sharding``: a sharding-stage trial)."""
    return replace(simulation_with(sharding), device_type="cuda", offload=trial)  # type: ignore[arg-type]


def test_a_near_capacity_zero2_rank_is_told_the_peak_from_x_to_y_the_host_ram_and_the_copies() -> None:
    advice = offload_optimizer(NEAR, healthy_setup(), offloading(OFFLOAD))  # type: ignore[arg-type]
    assert advice is not None and advice.id == "offload-optimizer"
    assert advice.title == (
        "Offloading the optimizer state to the CPU takes this rank's peak from 15.00 GiB to 10.00 GiB; host RAM"
        " needed 6.00 GiB"
    )
    assert advice.estimated_saving_bytes == 5 * GIB and advice.predicted_peak_bytes == 10 * GIB
    assert advice.saving_basis is SavingBasis.SIMULATED
    # 3.15 GB over PCIe 4.0 x16's 31.5 GB/s: 100 ms
    assert "copies 2.93 GiB between host and device per optimizer step: at least 100.0 ms a step over PCIe 4.0" in (
        advice.detail
    )
    assert "DeepSpeedCPUAdam" in advice.detail
    assert advice.detail.endswith('```python\nTrainer(strategy="deepspeed_stage_2_offload")\n```')
    assert "measured a peak of 15.00 GiB on the sampled step" in advice.evidence
    assert "93.8% of the device's 16.00 GiB" in advice.evidence
    given = {item.id: item for item in advise(NEAR, healthy_setup(), offloading(OFFLOAD))}  # type: ignore[arg-type]
    assert "offload-optimizer" in given
    assert "offload-optimizer: about 5.00 GiB (simulated)" in given["near-capacity"].detail  # among its remedies


def test_the_change_for_each_loop_and_strategy() -> None:
    assert strategy_code(OFFLOAD, TrainingLoop.FABRIC) == 'Fabric(strategy="deepspeed_stage_2_offload")'
    zero1 = replace(OFFLOAD, strategy="deepspeed_stage_1")  # Lightning registers no "deepspeed_stage_1_offload"
    assert strategy_code(zero1, TrainingLoop.LIGHTNING) == (
        "Trainer(strategy=DeepSpeedStrategy(stage=1, offload_optimizer=True))"
    )
    buckets = replace(OFFLOAD, strategy="deepspeed_stage_3", reduce_bucket_size=20_000, allgather_bucket_size=50_000)
    assert strategy_code(buckets, TrainingLoop.LIGHTNING) == (
        "Trainer(strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True, reduce_bucket_size=20_000,"
        " allgather_bucket_size=50_000))"
    )
    assert strategy_code(OFFLOAD, TrainingLoop.PLAIN).startswith(
        'config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}'
    )
    fsdp = replace(OFFLOAD, strategy="fsdp2", reduce_bucket_size=None, allgather_bucket_size=None)
    assert strategy_code(fsdp, TrainingLoop.LIGHTNING) == (
        "from torch.distributed.fsdp import CPUOffloadPolicy\nfully_shard(module, mesh=mesh,"
        " offload_policy=CPUOffloadPolicy())  # in configure_model: on every unit you shard, your other arguments kept"
    )
    advice = offload_optimizer(NEAR, healthy_setup(), offloading(fsdp))  # type: ignore[arg-type]
    assert advice is not None and advice.detail.startswith(
        "FSDP2's CPUOffloadPolicy keeps the sharded parameters, their gradients and the optimizer state in host memory"
    )


def test_silent_off_cuda_under_capacity_behind_a_stronger_stage_or_under_the_threshold_and_says_why() -> None:
    setup = healthy_setup()
    cases = {
        "cpu": (replace(NEAR, device=CPU), offloading(OFFLOAD)),
        "under": (
            healthy_summary(peak=peak(Phase.BACKWARD, 14 * GIB)),
            offloading(replace(OFFLOAD, measured_peak_bytes=14 * GIB)),
        ),
        "stronger": (
            NEAR,
            offloading(OFFLOAD, replace(TRIAL, measured_peak_bytes=15 * GIB, target_peak_bytes=9 * GIB)),
        ),
        "small": (NEAR, offloading(replace(OFFLOAD, target_peak_bytes=15 * GIB - 768 * MIB + 1))),
    }
    reasons = {}
    for name, (summary, simulation) in cases.items():
        assert offload_optimizer(summary, setup, simulation) is None, name  # type: ignore[arg-type]
        reasons[name] = {item.id: item.reason for item in not_advised(summary, setup, simulation, ())}.get(  # type: ignore[arg-type]
            "offload-optimizer"
        )
    assert reasons == {
        "cpu": "the host is the device off CUDA: offloading moves nothing off it",
        "under": "predicted, offload takes this rank's peak to 10.00 GiB, but its peak (87.5% of the device) is under"
        " the 90.0% the rule needs",
        "stronger": "a stronger sharding stage is advised first (sharding-stage): it adds communication, not host"
        " copies",
        "small": "predicted, offload takes this rank's peak to 14.25 GiB against 15.00 GiB: under the 5.0% saving the"
        " rule needs",
    }
    assert (
        offload_optimizer(NEAR, setup, offloading(replace(OFFLOAD, target_peak_bytes=15 * GIB - 768 * MIB))) is not None
    )
    assert offload_optimizer(NEAR, setup, offloading(None)) is None  # type: ignore[arg-type]
    assert wants_offload_trial(NEAR) and not wants_offload_trial(replace(NEAR, device=CPU))
    assert not wants_offload_trial(healthy_summary(peak=peak(Phase.BACKWARD, 14 * GIB)))


def test_the_offload_trial_survives_the_reports_json() -> None:
    simulation = offloading(OFFLOAD)
    data = simulation_to_dict(simulation)  # type: ignore[arg-type]
    assert data is not None and data["offload"]["saving_bytes"] == 5 * GIB
    back = simulation_from_dict(data)
    assert back is not None and back.offload == OFFLOAD
    zero3 = replace(OFFLOAD, strategy="deepspeed_stage_3", small_parameter_bytes=4096)
    again = simulation_from_dict(simulation_to_dict(offloading(zero3)))  # type: ignore[arg-type]
    assert again is not None and again.offload == zero3
    del data["offload"]["small_parameter_bytes"]  # as a report before it wrote it
    assert simulation_from_dict(data).offload == OFFLOAD  # type: ignore[union-attr]
    del data["offload"]  # as a report before it wrote it
    older = simulation_from_dict(data)
    assert older is not None and older.offload is None


def test_the_zero_trial_is_the_per_rank_models_figures_with_and_without_offload() -> None:
    predictor = predictor_of(1)
    spec = StrategySpec("deepspeed_stage_2", 4)
    trial = offload_trial(predictor, spec, SETTINGS, rank=1)
    assert isinstance(trial, OffloadTrial)
    now = predict_zero(predictor, spec, None, SETTINGS, 1)
    then = predict_zero(predictor, replace(spec, offload=True), None, SETTINGS, 1)
    assert isinstance(now, RankStep) and isinstance(then, RankStep)
    assert (trial.current_peak_bytes, trial.target_peak_bytes) == (now.peak.peak_bytes, then.peak.peak_bytes)
    assert trial.target_peak_bytes < trial.current_peak_bytes
    assert trial.host_bytes == then.host_bytes == 202_804 + 116_480  # the state with fp32 master, rank 1's gradients
    assert trial.transfer_bytes == 2 * 116_480  # its gradient partition to the host, its parameters back
    assert trial.measured_peak_bytes is None and trial.reduce_bucket_size == SETTINGS.reduce_bucket_size
    assert offload_trial(predictor, replace(spec, offload=True), SETTINGS, 1) is None  # offloading already
    assert offload_trial(predictor, StrategySpec("fsdp", 4), SETTINGS, 1) is None  # a live FSDP1 rank: not offered
    assert trial.small_parameter_bytes == 0  # ZeRO-2 keeps every parameter whole anyway
    zero3 = offload_trial(predictor, StrategySpec("deepspeed_stage_3", 4), SETTINGS, rank=1)
    assert isinstance(zero3, OffloadTrial)
    assert zero3.small_parameter_bytes == small_parameter_bytes(predictor.module, 4) > 0  # the change keeps 0


def test_a_near_capacity_cuda_rank_gets_the_trial_a_cpu_rank_never(gloo_one_rank: None) -> None:
    # One FSDP2 rank (a gloo group of one), its units read as the run sharded them, replayed by try_rank_changes as
    # the monitor does: on a CUDA run near capacity the simulation carries the rank predicted with offload; on the
    # CPU (the host is the device) it never does.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    network = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    module = Classifier(network, OPTIMIZERS["adam"])
    mesh = init_device_mesh("cpu", (1,))
    for layer in (network[0], network[2], network):
        fully_shard(layer, mesh=mesh)
    sharding = live_sharding([], module, 0)
    assert isinstance(sharding, LiveSharding) and isinstance(sharding.units, fsdp2.LiveUnits)
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    predictor = Predictor(module, None, batch, warm_up=True)
    replays = RankReplays(predictor, sharding.spec, sharding.settings, 0, sharding.units)
    setup = healthy_setup(strategy="ModelParallelStrategy")
    cpu = try_rank_changes(replays, replace(NEAR, device=CPU), setup)
    assert cpu.skipped is None and cpu.offload is None
    cuda = try_rank_changes(replays, NEAR, setup)
    assert cuda.skipped is None and isinstance(cuda.offload, OffloadTrial), cuda.skipped
    shards = (64 * 64 + 64 + 10 * 64 + 10) * 4
    assert cuda.offload.strategy == "fsdp2" and cuda.offload.host_bytes == 4 * shards + 4 * 4  # Adam: 4 steps
    # each unit gathered for forward and again for backward (the root holds no parameter), its gradient copied back
    assert cuda.offload.transfer_bytes == 3 * shards
    assert cuda.offload.target_peak_bytes < cuda.offload.current_peak_bytes
    assert dist.get_world_size() == 1


@pytest.mark.parametrize("loop", [TrainingLoop.LIGHTNING, TrainingLoop.FABRIC])
@pytest.mark.parametrize("buckets", [(200_000_000, 200_000_000), (20_000, 50_000)])
def test_the_printed_zero3_offload_runs_against_lightnings_deepspeed_strategy_as_predicted(
    loop: TrainingLoop, buckets: tuple[int, int]
) -> None:
    """The ZeRO-3 offload change run as printed with Lightning's and Fabric's own ``DeepSpeedStrategy`` (the owner a
    stand-in keeping the strategy; a strategy name looked up in the owner's registry, as the Trainer does): the
    optimizer offloaded and nothing else, every parameter partitioned as predicted, the run's buckets kept.

    Before, a run at Lightning's buckets was printed ``"deepspeed_stage_3_offload"``, whose config offloads the
    parameters too (``offload_param``) and has no ``stage3_param_persistence_threshold`` (DeepSpeed's default 100,000
    then keeps small parameters whole on every rank: a transformer LM held 2,107,760 B of parameters per rank where
    its row said 1,043,920); at other buckets the threshold alone was dropped."""
    if loop is TrainingLoop.FABRIC:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
        from lightning.fabric.strategies import DeepSpeedStrategy
    else:
        from lightning.pytorch.strategies import DeepSpeedStrategy
        from lightning.pytorch.strategies import StrategyRegistry as registry
    reduce, allgather = buckets
    trial = replace(
        OFFLOAD,
        strategy="deepspeed_stage_3",
        reduce_bucket_size=reduce,
        allgather_bucket_size=allgather,
        small_parameter_bytes=4096,
    )
    made: list[object] = []
    owner = "Fabric" if loop is TrainingLoop.FABRIC else "Trainer"
    keep = lambda strategy: made.append(registry.get(strategy) if isinstance(strategy, str) else strategy)  # noqa: E731
    exec(strategy_code(trial, loop), {"DeepSpeedStrategy": DeepSpeedStrategy, owner: keep})
    (strategy,) = made
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero.get("stage3_param_persistence_threshold") == 0
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == buckets
    # without small parameters nothing is set beyond the offload
    plain = replace(trial, small_parameter_bytes=0)
    assert "stage3_param_persistence_threshold" not in strategy_code(plain, loop)
