"""Lightning's sharded strategies on two CPU processes (gloo): ``python tests/sharded_train.py OUT_DIR STRATEGY``.

Run by test_distributed.py (and by test_sharded_advice.py with a third argument, ``mlp``: an MLP with LeakyReLU out
of place, 32 wide, whose advice a replay simulates). STRATEGY is ``fsdp2`` (``ModelParallelStrategy``,
``fully_shard`` in ``configure_model``) or ``deepspeed_stage_2`` / ``deepspeed_stage_3``. Lightning allows DeepSpeed
on CUDA only; ``CpuDeepSpeedStrategy`` lifts its CUDA-only checks (the three overrides below) and nothing else, so
the Trainer, DeepSpeed's engine and ZeRO optimizer and VramMonitor's hooks all run as on GPUs (tests/test_gpu.py
has the GPU run). Each rank writes its report's phase breakdowns, its simulation's skip reason and its advice's
saving bases to ``rankN.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # type: ignore[import-untyped]
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from advice_models import activation_mlp
from forked_ranks import lightning_ranks
from models import OPTIMIZERS, Classifier, dataset_for, linear_net, loader
from zero_fsdp1_ranks import ZERO_SETTINGS

from lightning_vram import VramMonitor

BATCH_SIZE = 16


class CpuDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy without its CUDA-only checks."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's "only supported on CUDA GPUs"

    def setup_distributed(self) -> None:
        reset_seed()  # as DeepSpeedStrategy does, less the check that device indices match local ranks
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        # As DeepSpeedStrategy does, with the local rank for device_rank (a CPU device has no index).
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer


class ShardedClassifier(Classifier):
    """Shards each layer and the network with FSDP2 over the strategy's data-parallel mesh."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.network:  # linear_net() is a Sequential
            fully_shard(layer, mesh=mesh)
        fully_shard(self.network, mesh=mesh)


class RecordReport(Callback):
    """After the monitor's own train-end hook, in each rank's process: its report's numbers."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (monitor,) = (callback for callback in trainer.callbacks if isinstance(callback, VramMonitor))  # type: ignore[attr-defined]
        report = monitor.report
        assert report is not None
        record = {
            "phases": {
                phase.value: [b.parameters, b.gradients, b.optimizer_state, b.activations]
                for phase, peak in report.phases.items()
                if (b := peak.breakdown) is not None
            },
            "ranks": len(report.ranks),
            "skipped": report.simulation.skipped if report.simulation is not None else "no simulation",
            "advice": {advice.id: str(advice.saving_basis) for advice in report.advice},
            "steps": report.steps,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def strategy_named(name: str, lightning_settings: bool = False) -> Strategy:
    """``name``'s strategy; with ``lightning_settings``, ZeRO's settings as ``DeepSpeedStrategy(stage=...)`` writes
    them (``overlap_comm``, ``contiguous_gradients``), the buckets small (tests/zero_fsdp1_ranks.py's)."""
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    stage = int(name.removeprefix("deepspeed_stage_"))
    config = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1000},
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": BATCH_SIZE,
    }
    if lightning_settings:
        config["zero_optimization"] = {"stage": stage, **ZERO_SETTINGS}
    return CpuDeepSpeedStrategy(config=config)


def main() -> None:
    out, name = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    monitor = VramMonitor(attribution_start_step=1, attribution_every_n_steps=1, console_summary=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_named(name, lightning_settings=sys.argv[3:] == ["mlp"]),
        max_steps=4,
        logger=False,
        default_root_dir=out,
        callbacks=[monitor, RecordReport(out)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    network = activation_mlp(nn.LeakyReLU, width=32) if sys.argv[3:] == ["mlp"] else linear_net()
    model = (ShardedClassifier if name == "fsdp2" else Classifier)(network, OPTIMIZERS["adam"])
    trainer.fit(model, loader(dataset_for("linear", samples=128), batch_size=BATCH_SIZE))  # 32 features


if __name__ == "__main__":
    lightning_ranks(main, 2, ("deepspeed",) if sys.argv[2].startswith("deepspeed") else ())
