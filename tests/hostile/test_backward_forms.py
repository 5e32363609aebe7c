"""The forms of backward a step may run: replayed, they leave the user's module and objects as they were.

``predict(..., device_type="cuda")`` on a machine without CUDA runs ``Tensor.backward`` and
``torch.autograd.backward`` through the engine with CUDA's kernels pushed again (``prediction/replay/cuda_kernels.py``;
a training run replays on its own device, without them). The step's own backward calls take every form: an auxiliary
loss backed twice with ``retain_graph``, ``inputs=`` (a tensor, a list), a gradient penalty through
``torch.autograd.grad(create_graph=True)``, a double backward, hooks that record in the user's objects (a tensor's, a
module's full backward hook, a parameter's post-accumulate hook), two ``manual_backward`` calls: each is replayed and
leaves weights, gradients, the hooks' record and the generator as they were (found passing, twelfth session).

A double backward (``backward(create_graph=True)``) gives each parameter a gradient whose graph holds the parameter,
a cycle through autograd's C++ the garbage collector cannot see; the replay's ``zero_grad`` breaks it where the step
runs to its end. A step that then reads a value (``penalty.item()``) stops the replay there: the copy's fake tensors
outlived it, and the escape check raised ``ReplayEscapeError`` out of ``predict()`` (19 fake tensors on the CPU, 20
for CUDA), and in training warned that the user's code stored them and turned replays off for the run (32 on the
CPU path). The replay now takes the gradients off its copy as it ends: the skip names the value read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched, equal
from models import OPTIMIZERS, Classifier, dataset_for, loader
from torch import nn

from lightning_vram import predict

SEEN: list[str] = []
"""What the user's hooks saw, in order."""
CREATE_GRAPH_WARNING = "ignore:Using backward\\(\\) with create_graph=True"
"""torch's warning on ``backward(create_graph=True)``, in the bare run as in the monitored one."""


def _network() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 10))


class Step(Classifier):
    """The classifier; each subclass runs its own backward calls in the step."""

    def __init__(self) -> None:
        super().__init__(_network(), OPTIMIZERS["adam"])


class AuxiliaryTwice(Step):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        outputs = self(inputs)
        auxiliary = outputs.pow(2).mean()
        auxiliary.backward(retain_graph=True)
        auxiliary.backward(inputs=self.network[0].weight, retain_graph=True)
        torch.autograd.backward([auxiliary * 2], inputs=list(self.network[3].parameters()), retain_graph=True)
        return nn.functional.cross_entropy(outputs, targets)


class GradientPenalty(Step):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        outputs = self(inputs)
        loss = nn.functional.cross_entropy(outputs, targets)
        gradients = torch.autograd.grad(loss, list(self.parameters()), create_graph=True)
        return loss + sum(gradient.pow(2).sum() for gradient in gradients)


class DoubleBackward(Step):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        outputs = self(inputs)
        outputs.pow(2).mean().backward(create_graph=True, retain_graph=True)
        penalty = sum(each.grad.pow(2).sum() for each in self.parameters() if each.grad is not None)
        return nn.functional.cross_entropy(outputs, targets) + penalty


class ReadsTheDoubleBackward(Step):
    """A double backward, then a value read from it (a threshold on the gradient penalty): no replay can run it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        outputs = self(inputs)
        outputs.pow(2).mean().backward(create_graph=True, retain_graph=True)
        penalty = sum(each.grad.pow(2).sum() for each in self.parameters() if each.grad is not None)
        scale = 0.0 if penalty.item() > 1e6 else 1.0
        return nn.functional.cross_entropy(outputs, targets) + scale * penalty


class Hooked(Step):
    def __init__(self) -> None:
        super().__init__()
        self.network[3].register_full_backward_hook(lambda module, inputs, outputs: SEEN.append("module"))
        for parameter in self.network.parameters():
            parameter.register_post_accumulate_grad_hook(lambda parameter: SEEN.append("accumulated"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        outputs = self(inputs)
        outputs.register_hook(_halved)
        return nn.functional.cross_entropy(outputs, targets)


def _halved(gradient: torch.Tensor) -> torch.Tensor:
    SEEN.append("tensor")
    return gradient * 0.5


class ManualTwice(Step):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self(inputs), targets)
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss * 0.5)
        optimizer.step()
        SEEN.append("stepped")
        return loss.detach()


def _state(module: Step) -> Any:
    """What the user could look at: weights, gradients, the hooks' record, the global generators."""
    weights = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    gradients = [None if each.grad is None else each.grad.clone() for each in module.parameters()]
    return weights, gradients, list(SEEN), torch.get_rng_state()


@pytest.mark.filterwarnings(CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("kind", [AuxiliaryTwice, GradientPenalty, DoubleBackward, Hooked, ManualTwice])
def test_a_backward_form_predicted_for_cuda_leaves_the_user_alone(kind: type[Step]) -> None:
    SEEN.clear()
    torch.manual_seed(0)
    module = kind()
    batch = next(iter(loader(dataset_for("linear"), batch_size=8)))
    before = _state(module)
    prediction = predict(module, batch, device_type="cuda", fit_table=False)
    assert prediction.step is not None, prediction.notes
    after = _state(module)
    assert equal(before, after)


@pytest.mark.filterwarnings(CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_double_backward_stopped_by_a_value_read_is_skipped_saying_so(device_type: str) -> None:
    module = ReadsTheDoubleBackward()
    batch = next(iter(loader(dataset_for("linear"), batch_size=8)))
    before = _state(module)
    prediction = predict(module, batch, device_type=device_type, fit_table=False)
    assert prediction.step is None and prediction.skipped is not None
    assert "reads a tensor's value" in prediction.skipped, prediction.skipped
    assert equal(before, _state(module))


@pytest.mark.filterwarnings(CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("path", PATHS)
def test_a_double_backward_stopped_by_a_value_read_trains_as_without_the_monitor(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        module = ReadsTheDoubleBackward()
        return Case(
            module,
            loader(dataset_for("linear"), batch_size=8),
            observe=lambda: [each.grad for each in module.parameters()],
        )

    monitor = assert_untouched(build, tmp_path, path, steps=3)
    assert monitor.report is not None and monitor.report.simulation is not None
    skipped = monitor.report.simulation.skipped
    assert skipped is not None and "reads a tensor's value" in skipped, skipped
