"""Outside the replay the monitor runs none of the user's code and no parametrization.

What the advice rules need to know of the set-up comes from module types and the attributes torch's own
constructors store, never from running a module's ``forward`` (``nn.Dropout`` would draw from torch's global
generator, a user's module may refuse the probe). Parametrized weights (``spectral_norm``, ``weight_norm``) are
read through their originals: reading ``Linear.weight`` runs the parametrization, and spectral norm's power
iteration rewrites its ``_u`` and ``_v`` buffers in training mode.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import PATHS, Case, assert_untouched
from lightning.pytorch.loggers import TensorBoardLogger
from models import Classifier, dataset_for, loader
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.data import DataLoader

from lightning_vram.measure.setup import RESULT_ONLY_INPLACE, inplace_keeps_result, training_setup

REPLAY = {"off": {"replay_budget_seconds": 0}, "on": {}}
"""The monitor with the replay switched off, and with its default budget."""


def replayed_as_asked(monitor: Any, replay: str) -> bool:
    """Whether the monitor replayed a step exactly when ``replay`` is on (the case tests what it says it tests)."""
    simulation = monitor.session.simulation
    return (simulation is not None and simulation.baseline is not None) is (replay == "on")


class ChannelsOnly(nn.Module):
    """A parameter-free module with an ``inplace`` flag whose forward accepts only ``(batch, channels, h, w)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inplace = False

    def forward(self, inputs: Tensor) -> Tensor:
        assert inputs.dim() == 4, "expects a feature map"
        return inputs * 0.5


class CountsCalls(nn.Module):
    """A parametrization that counts how often it ran (reading the parametrized tensor runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, weight: Tensor) -> Tensor:
        self.calls += 1
        return weight


class Refuses(nn.Module):
    """A module whose ``inplace`` is a property and whose forward raises: the set-up must touch neither."""

    @property
    def inplace(self) -> bool:
        raise AssertionError("the set-up read a property of the user's module")

    def forward(self, inputs: Tensor) -> Tensor:
        raise AssertionError("the set-up ran the user's forward")


def few_batches(name: str) -> DataLoader[Any]:
    """Two batches of 8 per epoch."""
    return loader(dataset_for(name, samples=16), batch_size=8)


@pytest.mark.parametrize("path", PATHS)
def test_dropout_draws_nothing_from_torchs_generator_at_setup(tmp_path: Path, path: str) -> None:
    """Three epochs, a TensorBoard logger (the set-up is read at every epoch's end), no replay: identical runs."""
    logs = tmp_path / "logs"

    def build() -> Case:
        network = nn.Sequential(nn.Linear(32, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 10))
        options = {"logger": TensorBoardLogger(logs), "max_epochs": 3}
        return Case(Classifier(network), few_batches("linear"), trainer_options=options)

    assert_untouched(build, tmp_path, path, steps=-1, **REPLAY["off"])


@pytest.mark.parametrize("path", PATHS)
def test_a_module_whose_forward_asserts_on_its_input_keeps_the_report(tmp_path: Path, path: str) -> None:
    """The set-up never calls the module, so its assertion cannot cost the report (``assert_untouched`` checks it)."""

    def build() -> Case:
        network = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), ChannelsOnly(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)
        )
        return Case(Classifier(network), few_batches("cnn"))

    assert_untouched(build, tmp_path, path)


@pytest.mark.parametrize("replay", sorted(REPLAY))
@pytest.mark.parametrize("path", PATHS)
def test_spectral_norm_buffers_move_only_with_training(tmp_path: Path, path: str, replay: str) -> None:
    """``_u`` and ``_v`` (in the state dict) and every weight end bit-identical, with the replay on or off."""

    def build() -> Case:
        head = parametrizations.spectral_norm(nn.Linear(32, 16))
        return Case(Classifier(nn.Sequential(head, nn.ReLU(), nn.Linear(16, 10))), few_batches("linear"))

    assert replayed_as_asked(assert_untouched(build, tmp_path, path, **REPLAY[replay]), replay)


@pytest.mark.parametrize("replay", sorted(REPLAY))
@pytest.mark.parametrize("path", PATHS)
def test_a_parametrization_runs_as_often_as_training_runs_it(tmp_path: Path, path: str, replay: str) -> None:
    """Weight norm and a counting parametrization on the same weight: the count is the bare run's count."""

    def build() -> Case:
        head = parametrizations.weight_norm(nn.Linear(32, 16))
        counter = CountsCalls()
        parametrize.register_parametrization(head, "weight", counter)
        network = nn.Sequential(head, nn.ReLU(), nn.Linear(16, 10))
        return Case(Classifier(network), few_batches("linear"), observe=lambda: counter.calls)

    assert replayed_as_asked(assert_untouched(build, tmp_path, path, **REPLAY[replay]), replay)


def test_training_setup_calls_no_module_and_reads_weights_through_their_originals() -> None:
    """Parametrized Linears count their originals' bytes, without running the parametrizations."""
    spectral = parametrizations.spectral_norm(nn.Linear(32, 16))
    counter = CountsCalls()
    normed = parametrizations.weight_norm(nn.Linear(16, 8))
    parametrize.register_parametrization(normed, "weight", counter)  # runs it once, to check what it returns
    model = nn.Sequential(spectral, nn.Dropout(0.5), Refuses(), ChannelsOnly(), normed, nn.LeakyReLU())
    before = [tensor.clone() for tensor in model.state_dict().values()]
    generator, calls = torch.get_rng_state(), counter.calls

    setup = training_setup(model, [])

    assert torch.equal(torch.get_rng_state(), generator)
    assert all(map(torch.equal, before, model.state_dict().values()))
    assert counter.calls == calls
    float32 = 4
    assert [(layer.name, layer.weight_bytes, layer.parameter_bytes) for layer in setup.linear_layers] == [
        ("0", 32 * 16 * float32, (32 * 16 + 16) * float32),  # spectral norm: the original weight, and the bias
        ("4", (8 + 8 * 16) * float32, (8 + 8 * 16 + 8) * float32),  # weight norm: g (8 x 1) and v (8 x 16)
    ]
    assert setup.inplace_keeps_result == ("5",)


def saves_only_its_result_inplace(module: nn.Module) -> bool:
    """The reference: run ``module``'s inplace variant on a throwaway tensor and watch what autograd saves.

    Inplace, the op overwrites its input; when it saves only its result, input and output are one saved tensor.
    An op that keeps a copy of its input, or refuses backward, saves something else or raises.
    """
    trial = type(module)(**{**settings_of(module), "inplace": True})
    trial.train(module.training)
    saved: set[int] = set()

    def pack(tensor: Tensor) -> Tensor:
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    start = torch.linspace(-2.0, 2.0, 16, requires_grad=True).reshape(1, 1, 4, 4)  # both sides of zero
    generator = torch.get_rng_state()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dropout's shape notices
            values = start.clone()
            result = trial(values)
        torch.autograd.grad(result.sum(), start)
    except RuntimeError:  # backward refused: "a negative slope ... not supported"
        return False
    finally:
        torch.set_rng_state(generator)
    address = values.untyped_storage().data_ptr()
    return result.untyped_storage().data_ptr() == address and saved == {address}


def settings_of(module: nn.Module) -> dict[str, Any]:
    """The constructor arguments ``module`` stored under their own names."""
    names = inspect.signature(type(module).__init__).parameters
    return {name: value for name, value in vars(module).items() if name in names}


def torch_modules_with_an_inplace_flag() -> list[nn.Module]:
    """Every ``torch.nn`` class that takes ``inplace``, with its defaults and with the settings that change it."""
    modules: list[nn.Module] = []
    for name in sorted(dir(nn)):
        kind = getattr(nn, name)
        if isinstance(kind, type) and issubclass(kind, nn.Module):
            parameters = inspect.signature(kind.__init__).parameters
            if "inplace" in parameters and kind is not nn.Threshold:
                modules.append(kind())
    modules += [nn.Threshold(0.1, 20.0), nn.Threshold(-1.0, -3.0), nn.Hardtanh(0.0, 1.0), nn.RReLU().eval()]
    modules += [nn.LeakyReLU(slope) for slope in (-0.1, -0.0, 0.0, 1e-9, 3.0)]
    modules += [nn.ELU(alpha) for alpha in (-1.0, -1e-9, 0.0, 1e-9, 2.0)]
    modules += [nn.CELU(alpha) for alpha in (-1.0, 0.0, 0.5, 2.0)]
    return modules


@pytest.mark.parametrize("module", torch_modules_with_an_inplace_flag(), ids=repr)
def test_the_inplace_table_agrees_with_torch(module: nn.Module) -> None:
    """The library's answer, from the type and its settings, is what running torch's op shows."""
    assert inplace_keeps_result(module) is saves_only_its_result_inplace(module)


def test_the_inplace_table_names_only_torch_classes_that_take_the_flag() -> None:
    known = {type(module) for module in torch_modules_with_an_inplace_flag()}
    assert set(RESULT_ONLY_INPLACE) <= known
    assert any(inplace_keeps_result(module) for module in torch_modules_with_an_inplace_flag())


def test_an_unknown_class_is_not_advised_even_when_it_subclasses_a_known_one() -> None:
    class Shifted(nn.ReLU):
        def forward(self, inputs: Tensor) -> Tensor:
            return super().forward(inputs - 1.0)

    assert inplace_keeps_result(nn.ReLU())
    assert not inplace_keeps_result(Shifted())
    assert not inplace_keeps_result(nn.ReLU(inplace=True))  # already inplace: nothing to advise
