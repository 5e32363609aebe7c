"""The training loop's whole surface, replayed, trains exactly as without the monitor.

Schedulers stepping per step and per epoch and ``ReduceLROnPlateau`` on a logged metric, gradient clipping,
an accumulation schedule, validation mid-epoch, ``limit_train_batches``, the user's ``on_before_optimizer_step``
reading gradients, ``validate``/``test``/``predict`` and a second ``fit`` on the same Trainer, SWA and the user's
own EMA callback: each case runs with and without the monitor (the CPU path, and the scripted CUDA path with its
preflight) and compares every step's loss, the learning rates, gradients the user saw, weights, optimizer and
scheduler state, the random generators, every checkpoint's training content and the user's warnings, exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, equal
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint, StochasticWeightAveraging
from loop_runs import Factory, run
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader
from test_replay_manual import ToggledGan
from test_setups import gan_data

from lightning_vram.records import Simulation


class Scheduled(Classifier):
    """A classifier with two schedulers (per step, and plateau on the logged validation loss), logging with
    ``sync_dist``, reading its gradients before every optimizer step and keeping every loss and learning rate."""

    def __init__(self, plateau_on: str | None = "val_loss") -> None:
        super().__init__(cnn_net(), OPTIMIZERS["sgd_momentum"])
        self.plateau_on = plateau_on
        self.seen: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.seen.append(("loss", batch_idx, loss.detach().clone()))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(("lr", [group["lr"] for group in self.trainer.optimizers[0].param_groups]))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", super().training_step(batch, batch_idx), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen.append(("grad norms", [p.grad.norm() for p in self.parameters() if p.grad is not None]))

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        per_step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5, threshold=1.0)
        schedulers = [{"scheduler": per_step, "interval": "step"}]
        if self.plateau_on is not None:  # SWA takes one scheduler only
            schedulers.append({"scheduler": plateau, "monitor": self.plateau_on, "interval": "epoch"})
        return [optimizer], schedulers


def state(module: pl.LightningModule, run_trainer: pl.Trainer) -> Any:
    return {
        "weights": {name: tensor.clone() for name, tensor in module.state_dict().items()},
        "optimizers": [optimizer.state_dict() for optimizer in run_trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in run_trainer.lr_scheduler_configs],
        "metrics": {name: value.clone() for name, value in run_trainer.callback_metrics.items()},
        "steps": (run_trainer.global_step, run_trainer.current_epoch),
    }


def assert_same(script: Any, tmp_path: Path, path: str, into: list[Any] | None = None, **options: Any) -> list[Any]:
    """``script`` run without and with the monitor, compared; the monitors made (``into``: the list to make them in)."""
    bare, _ = run(script, tmp_path / "bare", None)
    watched, monitors = run(script, tmp_path / "watched", path, into, **options)
    for key in bare:
        assert equal(bare[key], watched[key]), f"{key} differs"
    assert monitors and all(monitor.report is not None for monitor in monitors)
    return monitors


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("start", [1, 7])  # epoch 0 steps every batch; epoch 1 (from batch 6) every second one
def test_schedulers_clipping_accumulation_schedule_validation_and_evaluation_after_fit(
    tmp_path: Path, path: str, clip: str, start: int
) -> None:
    def script(make: Factory) -> Any:
        module = Scheduled()
        data = loader(dataset_for("cnn"), batch_size=8)
        run_trainer = make(
            [
                GradientAccumulationScheduler({1: 2}),
                ModelCheckpoint(every_n_train_steps=2, save_top_k=-1),
            ],
            max_steps=-1,
            max_epochs=2,
            limit_train_batches=6,
            val_check_interval=3,
            limit_val_batches=2,
            num_sanity_val_steps=0,
            gradient_clip_val=0.05,
            gradient_clip_algorithm=clip,
            enable_checkpointing=True,
        )
        run_trainer.fit(module, data, data)
        first = state(module, run_trainer)
        simulations.extend(callback.session.simulation for callback in run_trainer.callbacks if callback in monitors)
        validated = run_trainer.validate(module, data)
        tested = run_trainer.test(module, data)
        predicted = run_trainer.predict(module, data)
        run_trainer.fit_loop.max_epochs = 3  # a second fit on the same Trainer goes on for one more epoch
        run_trainer.accumulate_grad_batches = 1  # the schedule's own check at the start of a fit wants it back
        run_trainer.fit(module, data, data)
        return first, validated, tested, predicted, state(module, run_trainer), module.seen

    simulations: list[Any] = []
    monitors: list[Any] = []
    assert_same(script, tmp_path, path, attribution_start_step=start, attribution_every_n_steps=None, into=monitors)
    replayed(simulations[0])  # the first fit's replay, at step ``start``


def replayed(monitor: Any, matched: bool = True) -> None:
    """The monitor replayed a step of the run (and its replay reproduced the step measured, where ``matched``).

    The replay runs ``training_step`` alone: a hook or callback of the user's that allocates in the step (cloning the
    gradients in ``on_before_optimizer_step``) holds bytes the replay does not, and it is not matched (it says so).
    """
    simulation = monitor if isinstance(monitor, Simulation) else monitor.session.simulation
    assert simulation is not None and simulation.baseline is not None, simulation and simulation.skipped
    if matched:
        assert simulation.skipped is None, simulation.skipped
        assert simulation.match is not None and simulation.match.matches


class SavedMidWindow(pl.Callback):
    """The user's own checkpoint, saved mid-epoch after the first micro-batch of an accumulation window."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 2 and batch_idx == 4:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "mid_window.ckpt")


@pytest.mark.parametrize("path", PATHS)
def test_checkpoints_and_resumes_mid_window_with_and_without_the_monitor(tmp_path: Path, path: str) -> None:
    options = {"accumulate_grad_batches": 2, "enable_checkpointing": True, "max_epochs": 3}

    def write(make: Factory) -> Any:
        module = Scheduled("train_loss_epoch")
        data = loader(dataset_for("cnn"), batch_size=8)
        every = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
        run_trainer = make([every, SavedMidWindow()], max_steps=5, limit_val_batches=0, **options)
        run_trainer.fit(module, data)
        return state(module, run_trainer), module.seen

    def resume(checkpoint: Path) -> Any:
        def script(make: Factory) -> Any:
            module = Scheduled("train_loss_epoch")
            data = loader(dataset_for("cnn"), batch_size=8)
            every = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
            run_trainer = make([every], max_steps=7, limit_val_batches=0, **options)
            run_trainer.fit(module, data, ckpt_path=checkpoint)
            return state(module, run_trainer), module.seen

        return script

    sampled = {"attribution_start_step": 2, "attribution_every_n_steps": 2}
    written = {}
    for name, monitored in (("bare", None), ("watched", path)):
        written[name], monitors = run(write, tmp_path / name, monitored, **sampled)
        if monitors:
            replayed(monitors[0])
    for key in written["bare"]:
        assert equal(written["bare"][key], written["watched"][key]), f"{key} differs in the written run"
    resumed = {}
    for origin in ("bare", "watched"):
        for name, monitored in (("bare", None), ("watched", path)):
            checkpoint = tmp_path / origin / "mid_window.ckpt"
            root = tmp_path / f"{origin}_{name}"
            resumed[origin, name], monitors = run(resume(checkpoint), root, monitored, **sampled)
            resumed[origin, name]["warnings"] = [
                text.replace(str(tmp_path / origin), "<origin>") for text in resumed[origin, name]["warnings"]
            ]
            if monitors:
                replayed(monitors[0])
    # Lightning's own notice, resuming without a callback whose state the checkpoint holds: the one difference.
    notice = "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided"
    lightnings = [text for text in resumed["watched", "bare"]["warnings"] if notice in text]
    assert len(lightnings) == 1 and "VramMonitor{" in lightnings[0]
    resumed["watched", "bare"]["warnings"].remove(lightnings[0])
    first = resumed["bare", "bare"]
    for combination, outcome in resumed.items():
        for key in first:
            assert equal(first[key], outcome[key]), f"{key} differs, resumed {combination}"


class Averaged(pl.Callback):
    """The user's own EMA of the weights, updated after every optimizer step (on_train_batch_end)."""

    def __init__(self) -> None:
        self.average: dict[str, torch.Tensor] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for name, value in module.state_dict().items():
            if name not in self.average and value.is_floating_point():
                self.average[name] = value.detach().clone()
            elif value.is_floating_point():
                self.average[name].mul_(0.9).add_(value.detach(), alpha=0.1)

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average}


@pytest.mark.parametrize("path", PATHS)
def test_swa_and_the_users_ema_over_epochs_with_max_time(tmp_path: Path, path: str) -> None:
    def script(make: Factory) -> Any:
        module = Scheduled(None)
        data = loader(dataset_for("cnn"), batch_size=8)
        average = Averaged()
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
        run_trainer = make(
            [average, swa, ModelCheckpoint(every_n_epochs=1, save_top_k=-1)],
            max_steps=-1,
            max_epochs=3,
            max_time={"hours": 1},
            limit_train_batches=4,
            limit_val_batches=0,
            enable_checkpointing=True,
        )
        run_trainer.fit(module, data)
        return state(module, run_trainer), average.average, module.seen

    monitors = assert_same(script, tmp_path, path, attribution_start_step=1, attribution_every_n_steps=4)
    # The CPU counts every tensor live in the step's phases: the EMA's work at the batch's end counts in its optimizer
    # phase, which the replay (the step alone) does not run; it says so and its advice stays modelled.
    replayed(monitors[0], matched=path != "cpu")


class ScheduledGan(ToggledGan):
    """The toggled GAN with a scheduler per optimizer stepped by hand, ``self.log`` with ``sync_dist``, manual
    clipping, and the user's ``on_before_optimizer_step`` reading each optimizer's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        generator_schedule, discriminator_schedule = self.lr_schedulers()  # type: ignore[misc]
        generator_schedule.step()
        if (batch_idx + 1) % 2 == 0:
            discriminator_schedule.step()
        self.log("batch_mean", batch[0].mean(), sync_dist=True, on_step=True, on_epoch=True)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().manual_backward(loss, *args, **kwargs)
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen.append(
            [p.grad.norm() for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append([group["lr"] for optimizer in self.trainer.optimizers for group in optimizer.param_groups])

    def configure_optimizers(self) -> Any:
        generator, discriminator = super().configure_optimizers()
        return [generator, discriminator], [
            torch.optim.lr_scheduler.ExponentialLR(generator, gamma=0.9),
            torch.optim.lr_scheduler.StepLR(discriminator, step_size=1, gamma=0.5),
        ]


@pytest.mark.parametrize("path", PATHS)
def test_manual_gan_with_schedulers_by_hand_clipping_and_a_resume(tmp_path: Path, path: str) -> None:
    def write(make: Factory) -> Any:
        module = ScheduledGan()
        every = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
        run_trainer = make([every], max_steps=12, enable_checkpointing=True)
        run_trainer.fit(module, gan_data())
        return state(module, run_trainer), module.seen

    def resume(checkpoint: Path) -> Any:
        def script(make: Factory) -> Any:
            module = ScheduledGan()
            run_trainer = make(
                [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)], max_steps=20, enable_checkpointing=True
            )
            run_trainer.fit(module, gan_data(), ckpt_path=checkpoint)
            return state(module, run_trainer), module.seen

        return script

    sampled = {"attribution_start_step": 2, "attribution_every_n_steps": 3}
    monitors = assert_same(write, tmp_path / "written", path, **sampled)
    replayed(monitors[0])
    checkpoint = tmp_path / "written" / "bare" / "checkpoints" / "epoch=0-step=8.ckpt"  # mid-epoch
    monitors = assert_same(resume(checkpoint), tmp_path / "resumed", path, **sampled)
    replayed(monitors[0])
