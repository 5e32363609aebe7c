"""The ``sharding-stage`` rule on scripted trials, the trial's JSON, and the trial from one process's replay.

The rule reads :attr:`Simulation.sharding` (this rank under ZeRO-1/2 and under the next stage, by the per-rank model)
and prints the change for the loop that trains the model; tests/test_sharded_advice.py applies it on gloo.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from advice_summaries import MIB, healthy_setup, healthy_summary
from simulations import step
from test_rank_prediction_zero import SETTINGS, predictor_of

from lightning_vram.advice.rules.registry import advise, not_advised
from lightning_vram.advice.rules.sharding_stage import sharding_stage, strategy_code
from lightning_vram.prediction.strategies.deepspeed import predict_zero
from lightning_vram.prediction.strategies.stronger import sharding_trial, small_parameter_bytes, stronger
from lightning_vram.records import (
    Phase,
    RankStep,
    SavingBasis,
    ShardingTrial,
    Simulation,
    StrategySpec,
    TrainingLoop,
)
from lightning_vram.records.simulation_json import simulation_from_dict, simulation_to_dict

TRIAL = ShardingTrial(
    current="deepspeed_stage_2",
    target="deepspeed_stage_3",
    world_size=8,
    offload=False,
    current_peak_bytes=1000 * MIB,
    current_phase=Phase.BACKWARD,
    target_peak_bytes=600 * MIB,
    target_phase=Phase.BACKWARD,
    current_communication_bytes=700 * MIB,
    target_communication_bytes=1050 * MIB,
    target_host_bytes=0,
    method="arithmetic on the single-process replay (stage 3)",
    reduce_bucket_size=200_000_000,
    allgather_bucket_size=200_000_000,
    measured_peak_bytes=960 * MIB,
)
"""ZeRO-2 on 8 ranks under Lightning's bucket defaults, measured at 960 MiB, ZeRO-3 predicted at 600 MiB."""


def simulation_with(trial: ShardingTrial | None, skipped: str | None = None) -> Simulation:
    """A trusted simulation of a ZeRO run on the CPU carrying ``trial``."""
    baseline = step(960 * MIB, 960 * MIB, 900 * MIB, device="cpu")
    return Simulation("cpu", baseline, None, skipped, (), 0.5, sharding=trial)


def test_zero2_to_zero3_gives_the_peak_from_measured_x_to_predicted_y_the_traffic_and_the_exact_change() -> None:
    advice = sharding_stage(healthy_summary(), healthy_setup(), simulation_with(TRIAL))
    assert advice is not None and advice.id == "sharding-stage"
    assert advice.title == "ZeRO-2 to ZeRO-3 takes this rank's peak from 960.0 MiB to 600.0 MiB"
    assert advice.estimated_saving_bytes == 360 * MIB  # measured 960 less predicted 600, not the model's 1000
    assert advice.saving_basis is SavingBasis.SIMULATED and advice.predicted_peak_bytes == 600 * MIB
    assert "sends 350.0 MiB more per optimizer step (1.03 GiB against 700.0 MiB)" in advice.detail
    assert advice.detail.endswith('```python\nTrainer(strategy="deepspeed_stage_3")\n```')
    assert "host RAM" not in advice.detail and "param_persistence_threshold" not in advice.detail
    assert "measured a peak of 960.0 MiB on the sampled step (the model: 1000.0 MiB in backward)" in advice.evidence


def test_without_a_measured_peak_the_saving_is_the_models_own() -> None:
    advice = sharding_stage(
        healthy_summary(), healthy_setup(), simulation_with(replace(TRIAL, measured_peak_bytes=None))
    )
    assert advice is not None and advice.estimated_saving_bytes == 400 * MIB
    assert "peaks at 1000.0 MiB in backward by the per-rank model" in advice.evidence


def test_offload_kept_names_the_host_ram_and_lightnings_offload_strategy() -> None:
    trial = replace(TRIAL, offload=True, target_host_bytes=3 * 1024 * MIB)
    advice = sharding_stage(healthy_summary(), healthy_setup(), simulation_with(trial))
    assert advice is not None
    assert "need 3.00 GiB of host RAM per rank under ZeRO-3" in advice.detail
    assert advice.detail.endswith('Trainer(strategy="deepspeed_stage_3_offload")\n```')


def test_the_change_keeps_the_runs_buckets_and_partitions_small_parameters_as_predicted() -> None:
    trial = replace(TRIAL, reduce_bucket_size=20_000, allgather_bucket_size=50_000, small_parameter_bytes=4096)
    assert strategy_code(trial, TrainingLoop.LIGHTNING) == (
        "Trainer(strategy=DeepSpeedStrategy(stage=3, reduce_bucket_size=20_000, allgather_bucket_size=50_000,"
        " param_persistence_threshold=0))"
    )
    assert strategy_code(replace(trial, offload=True), TrainingLoop.FABRIC) == (
        "Fabric(strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True, reduce_bucket_size=20_000,"
        " allgather_bucket_size=50_000, param_persistence_threshold=0))"
    )
    assert strategy_code(trial, TrainingLoop.PLAIN).startswith(
        'config["zero_optimization"].update({"stage": 3, "stage3_param_persistence_threshold": 0})'
    )
    zero1 = replace(TRIAL, current="deepspeed_stage_1", target="deepspeed_stage_2", small_parameter_bytes=4096)
    assert strategy_code(zero1, TrainingLoop.LIGHTNING) == 'Trainer(strategy="deepspeed_stage_2")'
    advice = sharding_stage(healthy_summary(), healthy_setup(), simulation_with(zero1))
    assert advice is not None and advice.title.startswith("ZeRO-1 to ZeRO-2") and "Shard the gradients" in advice.detail


def test_silent_under_the_threshold_unsharded_or_untrusted_and_says_why() -> None:
    summary, setup = healthy_summary(), healthy_setup()
    small = replace(TRIAL, target_peak_bytes=913 * MIB)  # 47 MiB of 960: 4.9%
    assert sharding_stage(summary, setup, simulation_with(small)) is None
    reasons = {item.id: item.reason for item in not_advised(summary, setup, simulation_with(small), ())}
    assert reasons["sharding-stage"] == (
        "predicted, deepspeed_stage_3 x8 peaks at 913.0 MiB on this rank against 960.0 MiB under"
        " deepspeed_stage_2: under the 5.0% saving the rule needs"
    )
    assert sharding_stage(summary, setup, simulation_with(replace(TRIAL, target_peak_bytes=912 * MIB))) is not None
    assert sharding_stage(summary, setup, simulation_with(None)) is None  # not a ZeRO-1/2 run
    assert sharding_stage(summary, setup, simulation_with(TRIAL, skipped="the replay does not reproduce")) is None
    assert sharding_stage(summary, setup, None) is None
    assert "sharding-stage" in {item.id for item in advise(summary, setup, simulation_with(TRIAL))}


def test_the_trial_survives_the_reports_json() -> None:
    simulation = simulation_with(replace(TRIAL, offload=True, target_host_bytes=5, small_parameter_bytes=7))
    data = simulation_to_dict(simulation)
    assert data is not None and data["sharding"]["saving_bytes"] == 360 * MIB
    back = simulation_from_dict(data)
    assert back is not None and back.sharding == simulation.sharding
    del data["sharding"]  # as 0.11.0 wrote it
    older = simulation_from_dict(data)
    assert older is not None and older.sharding is None


def test_the_trial_is_the_per_rank_models_figures_for_both_stages() -> None:
    predictor = predictor_of(1)
    spec = StrategySpec("deepspeed_stage_2", 4)
    trial = sharding_trial(predictor, spec, SETTINGS, rank=2)
    assert isinstance(trial, ShardingTrial)
    now = predict_zero(predictor, spec, None, SETTINGS, 2)
    then = predict_zero(predictor, StrategySpec("deepspeed_stage_3", 4), None, SETTINGS, 2)
    assert isinstance(now, RankStep) and isinstance(then, RankStep)
    assert (trial.current_peak_bytes, trial.target_peak_bytes) == (now.peak.peak_bytes, then.peak.peak_bytes)
    assert (trial.current_communication_bytes, trial.target_communication_bytes) == (
        now.communication_bytes,
        then.communication_bytes,
    )
    assert trial.measured_peak_bytes is None  # the predictor holds no sampled step
    assert trial.target_host_bytes == 0 and trial.reduce_bucket_size == SETTINGS.reduce_bucket_size
    assert trial.small_parameter_bytes == small_parameter_bytes(predictor.module, 4) > 0
    offloaded = sharding_trial(predictor, StrategySpec("deepspeed_stage_1", 4, offload=True), SETTINGS, rank=0)
    assert isinstance(offloaded, ShardingTrial) and offloaded.target == "deepspeed_stage_2"
    host = predict_zero(predictor, StrategySpec("deepspeed_stage_2", 4, offload=True), None, SETTINGS, 0)
    assert isinstance(host, RankStep) and offloaded.target_host_bytes == host.host_bytes > 0
    assert offloaded.small_parameter_bytes == 0  # ZeRO-2 keeps every parameter whole anyway
    assert sharding_trial(predictor, StrategySpec("deepspeed_stage_3", 4), SETTINGS, rank=0) is None
    assert stronger(StrategySpec("ddp", 4)) is None


def test_small_parameters_are_those_deepspeed_persists() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(400, 250), torch.nn.Linear(250, 401))
    # 400 x 250 = 100,000 elements: persisted (at most the threshold); 250 x 401 = 100,250: partitioned
    assert small_parameter_bytes(module, 2) == (100_000 + 250 + 401) * 2
