"""The ``sharding-stage`` rule on scripted trials, the trial's JSON, and the trial from one process's replay.

The rule reads :attr:`Simulation.sharding` (this rank under ZeRO-1/2 and under the next stage, by the per-rank model)
and prints the change for the loop that trains the model; tests/test_sharded_advice.py applies it on gloo.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from advice_summaries import CPU, MIB, healthy_setup, healthy_summary
from lightning import Trainer
from simulations import step
from test_rank_prediction_zero import SETTINGS, loss_of, predictor_of

from lightning_vram.advice.rules.registry import advise, not_advised
from lightning_vram.advice.rules.sharding_stage import sharding_stage, strategy_code
from lightning_vram.measure.ddp import DEFAULT_BUCKET_BYTES, bucket_sizes, reduced_parameters
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.strategies import predict_rank
from lightning_vram.prediction.strategies.deepspeed import LIGHTNING_DEFAULTS, predict_zero
from lightning_vram.prediction.strategies.from_ddp import ddp_trial, targets
from lightning_vram.prediction.strategies.stronger import sharding_trial, small_parameter_bytes, stronger
from lightning_vram.records import (
    Phase,
    RankStep,
    ReplayedStep,
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
    # not Lightning's "deepspeed_stage_3_offload", printed before: it offloads the parameters too (offload_param)
    assert advice.detail.endswith("Trainer(strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True))\n```")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    made: list[DeepSpeedStrategy] = []
    exec(
        strategy_code(trial, TrainingLoop.LIGHTNING),
        {"DeepSpeedStrategy": DeepSpeedStrategy, "Trainer": lambda strategy: made.append(strategy)},
    )
    zero = made[0].config["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" in zero and "offload_param" not in zero


def test_the_change_keeps_the_runs_buckets_and_partitions_small_parameters_as_predicted() -> None:
    trial = replace(TRIAL, reduce_bucket_size=20_000, allgather_bucket_size=50_000, small_parameter_bytes=4096)
    assert strategy_code(trial, TrainingLoop.LIGHTNING) == (
        "strategy = DeepSpeedStrategy(stage=3, reduce_bucket_size=20_000, allgather_bucket_size=50_000)\n"
        'strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every parameter,'
        " as predicted\nTrainer(strategy=strategy)"
    )
    assert strategy_code(replace(trial, offload=True), TrainingLoop.FABRIC) == (
        "strategy = DeepSpeedStrategy(stage=3, offload_optimizer=True, reduce_bucket_size=20_000,"
        ' allgather_bucket_size=50_000)\nstrategy.config["zero_optimization"]["stage3_param_persistence_threshold"]'
        " = 0  # partition every parameter, as predicted\nFabric(strategy=strategy)"
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


FROM_DDP = replace(
    TRIAL,
    current="ddp",
    target="fsdp",
    target_sharding="FULL_SHARD",
    reduce_bucket_size=None,
    allgather_bucket_size=None,
    method="arithmetic on the single-process replay (FULL_SHARD); deepspeed_stage_2 x8 predicted at 1,700,000,000"
    " bytes",
)
"""DDP on 8 ranks measured at 960 MiB (the model: 1000), FSDP full shard predicted at 600 MiB, sending 1050 MiB a
step against DDP's all-reduce of 700 MiB."""
ZERO2_PLAIN = (
    'model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={"zero_optimization":'
    ' {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 200_000_000,'
    ' "allgather_bucket_size": 200_000_000}, ...})  # in place of DistributedDataParallel(model)'
)
"""The plain loop's change from DDP to ZeRO-2, with Lightning's DeepSpeedStrategy defaults the prediction used."""


def test_ddp_to_fsdp_full_shard_gives_the_peak_the_traffic_and_each_loops_change() -> None:
    summary, setup = healthy_summary(), healthy_setup()
    advice = sharding_stage(summary, setup, simulation_with(FROM_DDP))
    assert advice is not None and advice.id == "sharding-stage"
    assert advice.title == "DDP to FSDP (full shard) takes this rank's peak from 960.0 MiB to 600.0 MiB"
    assert advice.estimated_saving_bytes == 360 * MIB and advice.predicted_peak_bytes == 600 * MIB
    assert advice.detail.startswith(
        "Shard the parameters, gradients and optimizer state: at the same 8 ranks, FSDP (full shard) saves 360.0 MiB"
        " of this rank's peak and sends 350.0 MiB more per optimizer step (1.03 GiB against 700.0 MiB)."
    )
    assert "the root as the only unit" in advice.detail and "host RAM" not in advice.detail
    assert advice.detail.endswith('```python\nTrainer(strategy="fsdp")\n```')
    assert "this rank under DDP x8 measured a peak of 960.0 MiB on the sampled step" in advice.evidence
    assert "deepspeed_stage_2 x8 predicted at 1,700,000,000 bytes" in advice.evidence  # the other candidate
    assert strategy_code(FROM_DDP, TrainingLoop.FABRIC) == 'Fabric(strategy="fsdp")'
    assert strategy_code(FROM_DDP, TrainingLoop.PLAIN).startswith(
        "model = torch.distributed.fsdp.FullyShardedDataParallel(model, device_id=torch.cuda.current_device())"
    )


def test_ddp_to_zero2_names_lightnings_strategy_and_the_plain_loops_config() -> None:
    trial = replace(
        FROM_DDP,
        target="deepspeed_stage_2",
        target_sharding=None,
        reduce_bucket_size=200_000_000,
        allgather_bucket_size=200_000_000,
        target_communication_bytes=700 * MIB,
    )
    advice = sharding_stage(healthy_summary(), healthy_setup(), simulation_with(trial))
    assert advice is not None
    assert advice.title == "DDP to ZeRO-2 takes this rank's peak from 960.0 MiB to 600.0 MiB"
    assert "Shard the gradients and optimizer state: at the same 8 ranks, ZeRO-2 saves 360.0 MiB" in advice.detail
    assert "sends 700.0 MiB per optimizer step, no more than now" in advice.detail
    assert advice.detail.endswith('```python\nTrainer(strategy="deepspeed_stage_2")\n```')
    assert strategy_code(trial, TrainingLoop.PLAIN) == ZERO2_PLAIN


def test_from_ddp_silent_under_5_percent_of_the_measured_peak_and_says_why() -> None:
    summary, setup = healthy_summary(), healthy_setup()
    under = replace(FROM_DDP, target_peak_bytes=913 * MIB)  # 47 MiB of the measured 960: 4.9%
    assert sharding_stage(summary, setup, simulation_with(under)) is None
    reasons = {item.id: item.reason for item in not_advised(summary, setup, simulation_with(under), ())}
    assert reasons["sharding-stage"] == (
        "predicted, fsdp x8 FULL_SHARD peaks at 913.0 MiB on this rank against 960.0 MiB under ddp: under the 5.0%"
        " saving the rule needs"
    )
    assert sharding_stage(summary, setup, simulation_with(replace(FROM_DDP, target_peak_bytes=912 * MIB))) is not None
    # The model's own figure for DDP (1000 MiB) would make 913 a saving of 8.7%: the measured peak is the start.
    assert sharding_stage(summary, setup, simulation_with(replace(under, measured_peak_bytes=None))) is not None


def ddp_predictor(buckets: bool) -> Predictor:
    """One process's replay of an MLP's step (Adam, batch 64), holding DDP's gradient buckets where ``buckets``."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    held = bucket_sizes(reduced_parameters(module), DEFAULT_BUCKET_BYTES, torch.float32) if buckets else None
    return Predictor(
        module,
        [torch.optim.Adam(module.parameters(), lr=1e-3)],
        torch.randn(64, 256),
        step_function=loss_of,
        warm_up=True,
        strategy=held,
    )


def test_the_ddp_trial_is_predict_ranks_figures_on_the_step_without_ddps_buckets() -> None:
    # The DDP rank's predictor holds the buckets in every replay; ZeRO-2 and FSDP hold none, so the trial's targets
    # must be predict_rank's on a plain Predictor of the same module and batch, not on the bucketed one.
    bucketed, plain = ddp_predictor(True), ddp_predictor(False)
    assert bucketed.strategy is not None and bucketed.strategy.total_bytes == 1_597_480  # 399,370 fp32 gradients
    baseline = bucketed.replay()
    assert isinstance(baseline, ReplayedStep)
    trial = ddp_trial(bucketed, baseline, 2, 1)
    assert isinstance(trial, ShardingTrial)
    zero, fsdp = targets(2)
    by_name = {
        "deepspeed_stage_2": predict_zero(plain, zero, None, LIGHTNING_DEFAULTS, 1),
        "fsdp": predict_rank(plain, fsdp),
    }
    ddp = predict_rank(plain, StrategySpec("ddp", 2))
    assert all(isinstance(step, RankStep) for step in (*by_name.values(), ddp))
    chosen = by_name[trial.target]
    assert isinstance(chosen, RankStep) and isinstance(ddp, RankStep)
    print({name: step.peak.peak_bytes for name, step in by_name.items() if isinstance(step, RankStep)}, trial)
    # On 400K parameters ZeRO-2's two 2e8-element reduce buckets (1.6 GB) dwarf the step: FSDP is the lower.
    assert trial.target == "fsdp" and trial.target_sharding == "FULL_SHARD"
    assert (trial.target_peak_bytes, trial.target_phase) == (chosen.peak.peak_bytes, chosen.peak.phase)
    assert trial.target_communication_bytes == chosen.communication_bytes
    assert (trial.current_peak_bytes, trial.current_phase) == (ddp.peak.peak_bytes, ddp.peak.phase)
    assert trial.current_communication_bytes == ddp.communication_bytes == 1_597_480  # 2(N-1)/N of the buckets
    zero2 = by_name["deepspeed_stage_2"]
    assert isinstance(zero2, RankStep) and zero2.peak.peak_bytes > 1_600_000_000
    assert f"{zero.label} predicted at {zero2.peak.peak_bytes:,} bytes" in trial.method
    with_buckets = predict_rank(bucketed, fsdp)  # what the bucketed predictor would give: the buckets counted twice
    assert isinstance(with_buckets, RankStep)
    backward = Phase.BACKWARD  # where DDP's buckets are held (the optimizer step, FSDP's peak here, holds none)
    assert with_buckets.phases[backward].peak_bytes > chosen.phases[backward].peak_bytes
    assert trial.measured_peak_bytes is None and trial.reduce_bucket_size is None
    assert ddp_trial(bucketed, baseline, 1, 0) is None  # one rank: nothing to shard over
    assert ddp_trial(plain, baseline, 2, 0) is None  # not a DDP rank's predictor


def test_a_ddp_run_on_the_cpu_is_not_told_a_strategy_lightning_refuses_there_and_says_why() -> None:
    # A new user's DDP run on 2 gloo ranks was told 'Trainer(strategy="fsdp")', which Lightning refuses on the CPU.
    for name in ("fsdp", "deepspeed_stage_2"):
        with pytest.raises((ValueError, RuntimeError), match="GPU"):
            Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy.setup_environment()
    summary, setup = healthy_summary(device=CPU), healthy_setup()
    zero2 = replace(FROM_DDP, target="deepspeed_stage_2", target_sharding=None)
    for trial in (FROM_DDP, zero2):
        assert sharding_stage(summary, setup, simulation_with(trial)) is None
        assert "sharding-stage" not in {item.id for item in advise(summary, setup, simulation_with(trial))}
    reasons = {item.id: item.reason for item in not_advised(summary, setup, simulation_with(FROM_DDP), ())}
    assert reasons["sharding-stage"] == (
        "predicted, fsdp x8 FULL_SHARD peaks at 600.0 MiB on this rank against 960.0 MiB under ddp, but this run trains"
        " on cpu: Lightning's and Fabric's fsdp strategy requires a CUDA accelerator and refuses this one (the plain"
        " loop's change is written for CUDA)"
    )
    # A ZeRO run off CUDA (a plain loop's DeepSpeed on the CPU) still gets its stronger stage: its config change.
    assert sharding_stage(summary, setup, simulation_with(TRIAL)) is not None


@pytest.mark.parametrize("loop", [TrainingLoop.LIGHTNING, TrainingLoop.FABRIC])
@pytest.mark.parametrize("offload", [False, True])
def test_the_printed_zero3_change_runs_against_lightnings_deepspeed_strategy(loop: TrainingLoop, offload: bool) -> None:
    """The code the advice prints, run as printed with Lightning's and Fabric's own ``DeepSpeedStrategy`` (the owner a
    stand-in that keeps the strategy: a Trainer with it refuses the CPU): the strategy it makes partitions every
    parameter, as predicted, with the run's buckets kept. ``DeepSpeedStrategy(param_persistence_threshold=0)``, printed
    before, raised ``TypeError: ... unexpected keyword argument 'param_persistence_threshold'``."""
    if loop is TrainingLoop.FABRIC:
        from lightning.fabric.strategies import DeepSpeedStrategy
    else:
        from lightning.pytorch.strategies import DeepSpeedStrategy
    trial = replace(
        TRIAL, reduce_bucket_size=20_000, allgather_bucket_size=50_000, small_parameter_bytes=4096, offload=offload
    )
    made: list[object] = []
    owner = "Fabric" if loop is TrainingLoop.FABRIC else "Trainer"
    exec(
        strategy_code(trial, loop),
        {"DeepSpeedStrategy": DeepSpeedStrategy, owner: lambda strategy: made.append(strategy)},
    )
    (strategy,) = made
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 0
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (20_000, 50_000)
    assert ("offload_optimizer" in zero) is offload
