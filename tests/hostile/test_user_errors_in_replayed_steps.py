"""The user's own error, raised inside a sampled manual-optimization or accumulating step, reaches them untouched.

Both kinds of step are replayed now (the replay calls the user's ``training_step`` again, two micro-batches under
accumulation, ``manual_backward`` and each optimizer's ``step`` under manual optimization). An error the user's step
raises mid-way through a sampled step (after a backward, between micro-batches) must come out of ``fit`` as the very
object the step raised, after the same number of real calls as without the monitor, and leave nothing of the
monitor behind: no module or global hook, no saved-tensor hooks, dispatch or torch-function mode on the stacks, grad
mode as it was. Each case runs with and without the monitor on the CPU path and the scripted CUDA path (preflight).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from harness import PATHS, monitor_for
from models import OPTIMIZERS, Classifier, cnn_net, dataset_for, loader, trainer
from test_replay_manual import ToggledGan
from test_setups import gan_data
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_vram.prediction.containment._torch_hooks import global_registries


class UserError(Exception):
    """The user's own error."""


CALLS: list[int] = []
"""Every real call of a ``training_step`` below, by its ``batch_idx`` (a global: a replay's calls are put back)."""


class FailingGan(ToggledGan):
    """The toggled GAN, raising its own error on its second batch after the generator's backward and step."""

    def __init__(self, error: UserError) -> None:
        super().__init__()
        self.error = error

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().manual_backward(loss, *args, **kwargs)
        if len(CALLS) == 2 and CALLS[-1] == 1:
            raise self.error

    def training_step(self, batch: Any, batch_idx: int) -> None:
        CALLS.append(batch_idx)
        super().training_step(batch, batch_idx)


class FailingAccumulator(Classifier):
    """A classifier under ``accumulate_grad_batches=2`` raising its own error on the second micro-batch of step 1."""

    def __init__(self, error: UserError) -> None:
        super().__init__(cnn_net(), OPTIMIZERS["adam"])
        self.error = error

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        CALLS.append(batch_idx)
        if len(CALLS) == 4:
            raise self.error
        return super().training_step(batch, batch_idx)


def leftovers(module: nn.Module) -> dict[str, Any]:
    """What the monitor could leave behind: hooks on the module and its parameters, torch's stacks and registries."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)
    return {
        "module_hooks": sum(
            len(hooks)
            for child in module.modules()
            for hooks in (
                child._forward_hooks,
                child._forward_pre_hooks,
                child._backward_hooks,
                child._backward_pre_hooks,
                child._state_dict_hooks,
            )
        ),
        "parameter_hooks": sum(
            len(parameter._post_accumulate_grad_hooks or {}) + len(parameter._backward_hooks or {})
            for parameter in module.parameters()
        ),
        "global_hooks": sum(len(registry) for registry in global_registries()),
        "saved_tensor_hooks": top(False) is not None,
        "dispatch_mode": _get_current_dispatch_mode() is not None,
        "function_modes": torch._C._len_torch_function_stack(),
        "grad": torch.is_grad_enabled(),
    }


def fail(build: type[pl.LightningModule], root: Path, monitor: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Train until the user's error; what came out, how many real calls ran, and what was left behind."""
    CALLS.clear()
    pl.seed_everything(0, verbose=False)
    error = UserError("the user's own")
    module = build(error)
    data = gan_data() if build is FailingGan else loader(dataset_for("cnn"), batch_size=8)
    callbacks = [monitor] if monitor is not None else []
    with pytest.raises(UserError) as raised:
        trainer(root, callbacks, max_steps=8, **options).fit(module, data)
    return {"same_object": raised.value is error, "calls": list(CALLS), **leftovers(module)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["manual", "accumulating"])
def test_the_users_error_in_a_sampled_step_reaches_them_untouched(tmp_path: Path, path: str, kind: str) -> None:
    build: Any = FailingGan if kind == "manual" else FailingAccumulator
    options = {} if kind == "manual" else {"accumulate_grad_batches": 2}
    bare = fail(build, tmp_path / "bare", None, options)
    watched = fail(build, tmp_path / "watched", monitor_for(path, attribution_start_step=1), options)
    assert bare["same_object"] and bare["function_modes"] == 0 and not bare["saved_tensor_hooks"]
    assert watched == bare
