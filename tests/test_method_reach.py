"""The walk follows a user class's methods only where the code a replay runs may call them, by name.

Found by a new user's trial: a LightningModule with an ``export`` method calling ``torch.save``, which training never
calls, had every replay refused ("may call torch.save"): the walk took in every method of every class of the model,
so the run's advice fell back to modelled savings (62.0 MiB promised, 47.5 MiB realised). A ``validation_step`` or an
``on_train_epoch_end`` writing a file did the same, though a replay runs the training step only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_vram.advice.checkpoint_code import CHECKPOINTED_CLASS, KEEPING_BUFFERS
from lightning_vram.prediction.containment.code_roots import code_roots, data_roots, inside_ids, instance_roots
from lightning_vram.prediction.containment.method_reach import OUTSIDE_BATCH_HOOKS, computed_names, library_names
from lightning_vram.prediction.containment.reach import Reach, reach_of

OUTPUT = Path("never-written")

SAVES = "Exporting.export may call torch.save (a file it writes would be written again)"
OPENS = "Exporting.validation_step opens files (what it writes would be written again)"
COPIES = "Exporting.on_train_epoch_end changes files"


class Exporting(pl.LightningModule):
    """A model whose ``export``, ``validation_step`` and ``on_train_epoch_end`` act on files; its training step does
    not call them."""

    def __init__(self, action: str = "export") -> None:  # a string constant in walked code would bring the name in
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.action = action

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def export(self, path: Path) -> None:
        torch.save(self.state_dict(), path)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        with open(OUTPUT / "validation.txt", "a") as log:
            log.write(f"{batch_idx}\n")

    def on_train_epoch_end(self) -> None:
        shutil.copy(OUTPUT / "a", OUTPUT / "b")


class CallsExport(Exporting):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1000:
            self.export(OUTPUT / "model.pt")
        return super().training_step(batch, batch_idx)


class CallsAHelper(Exporting):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self._maybe_save(batch_idx)
        return super().training_step(batch, batch_idx)

    def _maybe_save(self, batch_idx: int) -> None:
        if batch_idx == 1000:
            self.export(OUTPUT / "model.pt")


class CallsByAConstantName(Exporting):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1000:
            self.export(OUTPUT / "model.pt")
        return super().training_step(batch, batch_idx)


class CallsThroughSuper(Exporting):
    def export(self, path: Path) -> None:  # its own does nothing outside: the one it overrides does
        pass

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1000:
            super().export(OUTPUT / "model.pt")
        return super().training_step(batch, batch_idx)


class CallsByAComputedName(Exporting):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1000:
            getattr(self, self.action)(OUTPUT / "model.pt")
        return super().training_step(batch, batch_idx)


class SetsByAComputedName(Exporting):
    """Sets attributes by a name it computes: a property's setter may run, no other method."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        setattr(self, self.action + "_count", batch_idx)
        return super().training_step(batch, batch_idx)

    @property
    def export_count(self) -> int:
        return 0

    @export_count.setter
    def export_count(self, value: int) -> None:
        with open(OUTPUT / "count.txt", "w") as log:
            log.write(f"{value}\n")


class ReadsTheTrainer(Exporting):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 1000:
            self.trainer.save_checkpoint(OUTPUT / "last.ckpt")  # runs on_save_checkpoint, and any other hook
        return super().training_step(batch, batch_idx)


def effects(module: nn.Module) -> list[str]:
    """What the walk a sampled step makes finds the module's code doing outside the objects a replay puts back."""
    return sorted(walk(module).effects)


def walk(module: nn.Module) -> Reach:
    roots = [*code_roots(module, None), *instance_roots(module)]
    return reach_of(roots, inside_ids(module), data_roots(module))


def test_a_method_the_training_step_never_calls_is_not_walked() -> None:
    assert effects(Exporting()) == []


def test_a_method_the_training_step_calls_is_walked_however_it_names_it() -> None:
    assert effects(CallsExport()) == [SAVES]
    assert effects(CallsAHelper()) == [SAVES]
    assert effects(CallsByAConstantName()) == [SAVES]
    assert effects(CallsThroughSuper()) == [SAVES]


def test_a_name_computed_at_run_time_brings_every_method_in() -> None:
    assert effects(CallsByAComputedName()) == sorted([SAVES, OPENS, COPIES])
    assert effects(CallsByAConstantName()) == [SAVES]  # a constant name brings that name only


def test_a_name_computed_to_set_an_attribute_brings_the_setters_in_and_no_other_method() -> None:
    setter = "SetsByAComputedName.export_count opens files (what it writes would be written again)"
    assert effects(SetsByAComputedName()) == [setter]


def test_the_trainer_read_in_the_step_brings_lightning_s_other_hooks_in() -> None:
    assert effects(ReadsTheTrainer()) == sorted([OPENS, COPIES])  # export: no code names it
    assert {"on_save_checkpoint", "validation_step", "on_train_epoch_end"} <= OUTSIDE_BATCH_HOOKS


def test_the_hooks_left_out_are_lightning_s_and_its_batch_hooks_stay_in() -> None:
    """Every name left out is one Lightning's module defines (a renamed hook would show here)."""
    defined = {name for cls in pl.LightningModule.__mro__ for name in vars(cls)}
    assert defined >= OUTSIDE_BATCH_HOOKS
    in_reach = {name for cls in pl.LightningModule.__mro__ for name in library_names(cls)}
    assert in_reach & OUTSIDE_BATCH_HOOKS == set()
    batch = {"training_step", "on_train_batch_start", "on_before_backward", "backward", "on_after_backward"}
    batch |= {"on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step", "optimizer_zero_grad"}
    batch |= {"on_before_zero_grad", "on_train_batch_end", "lr_scheduler_step", "transfer_batch_to_device"}
    batch |= {"configure_optimizers", "configure_model", "forward", "manual_backward"}  # the replay calls these too
    assert in_reach >= batch


class OpensInTheStep:
    """A mixin whose ``training_step`` overrides LightningModule's: only a class built on Lightning's brings it in."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        with open(OUTPUT / "steps.txt", "a") as log:
            log.write(f"{batch_idx}\n")
        return batch.sum()


class MixedIn(OpensInTheStep, pl.LightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_mixin_s_method_comes_in_reach_whichever_class_the_walk_meets_first() -> None:
    opens = "OpensInTheStep.training_step opens files (what it writes would be written again)"
    assert reach_of([("mixin", OpensInTheStep)], set()).effects == []
    assert reach_of([("mixin", OpensInTheStep), ("model", MixedIn)], set()).effects == [opens]
    assert reach_of([("model", MixedIn), ("mixin", OpensInTheStep)], set()).effects == [opens]


def test_a_hook_on_the_copy_calling_a_method_finds_it_through_the_walk_it_goes_on_from() -> None:
    """The replay walks the module's classes once, then each replay's copy: a hook the copy holds calling ``export``
    reaches the method the first walk left for want of its name."""
    module = Exporting()
    module.layer.register_forward_hook(lambda layer, inputs, output: module.export(OUTPUT / "hooked.pt"))
    inside = inside_ids(module)
    classes = reach_of(code_roots(module, None), inside)
    assert classes.effects == [] and "export" in classes.methods.parked
    held = reach_of(instance_roots(module), inside, after=classes)
    assert held.effects == [SAVES]
    assert "export" in classes.methods.parked  # the first walk is left as it was, for the next replay's copy


class BatchHooks(Exporting):
    """Lightning's hooks that run inside a training batch stay in reach; the other loops' do not."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        with open(OUTPUT / "losses.txt", "a") as log:
            log.write(f"{loss}\n")

    def on_after_backward(self) -> None:
        torch.func.grad(lambda x: x.sum())(torch.ones(1))

    def on_validation_epoch_end(self) -> None:
        torch.func.vjp(lambda x: x.sum(), torch.ones(1))


def test_lightning_s_batch_hooks_are_walked_and_the_other_loops_hooks_are_not() -> None:
    reach = walk(BatchHooks())
    assert reach.effects == ["BatchHooks.on_before_backward opens files (what it writes would be written again)"]
    assert reach.hook_apis == {"torch.func.grad"}  # not on_validation_epoch_end's vjp


class Batch:
    """A batch class: Lightning moves it to the device with its ``to``; its ``save`` nothing calls."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs

    def to(self, device: Any) -> Batch:
        with open(OUTPUT / "moves.txt", "a") as log:
            log.write(f"{device}\n")
        return Batch(self.inputs.to(device))

    def save(self, path: Path) -> None:
        torch.save(self.inputs, path)


def test_a_batch_s_to_is_in_reach_and_its_other_methods_are_not() -> None:
    module = Exporting()
    reach = reach_of(code_roots(module, None, (), Batch(torch.ones(1))), inside_ids(module))
    assert reach.effects == ["Batch.to opens files (what it writes would be written again)"]


exec(KEEPING_BUFFERS + CHECKPOINTED_CLASS)  # the wrapper exactly as the advice prints it, in this file's globals


def test_the_printed_wrapper_passing_on_the_name_it_is_asked_brings_nothing_more_in() -> None:
    """``Checkpointed.__getattr__`` reads ``getattr(self.block, name)``: only names read elsewhere reach it."""
    wrapper = Checkpointed  # type: ignore[name-defined]  # noqa: F821 -- defined by the exec above
    assert not computed_names(wrapper.__getattr__.__code__).reads
    module = Exporting()
    module.layer = wrapper(module.layer)
    assert effects(module) == []
