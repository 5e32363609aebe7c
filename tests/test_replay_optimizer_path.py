"""The replay's optimizer takes the path torch takes for the real parameters: foreach, fused or the for-loop.

torch checks ``type(p)`` exactly (``Tensor`` or ``Parameter``): a fake parameter, a ``FakeTensor``, is refused the
foreach path even on a (fake) CUDA device. A CUDA-placed real parameter cannot exist without a GPU, so the resolver
is a pure function tested directly; a replay where it answers foreach runs ``torch._foreach_*`` on CPU fake tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import OPTIMIZERS, Classifier
from torch import nn
from torch.optim.optimizer import _default_to_fused_or_foreach

from lightning_vram.prediction.predictor import Predictor
from lightning_vram.prediction.replay import optimizer_path
from lightning_vram.prediction.replay._fake import FakeTensor, FakeTensorMode
from lightning_vram.prediction.replay.optimizer_path import OptimizerPath, resolve_path
from lightning_vram.prediction.replay.twin import make_twin
from lightning_vram.records import Phase, ReplayedStep

UNSET = {"foreach": None, "fused": None, "differentiable": False, "capturable": False, "lr": 1e-3}
"""A param group as the user leaves it: torch picks the path."""


def test_a_fake_parameter_on_cuda_is_refused_foreach_where_the_real_one_gets_it() -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = nn.Parameter(FakeTensor(mode, torch.empty(4, device="meta"), torch.device("cuda:0")))
    assert type(fake) is FakeTensor and fake.device.type == "cuda"
    # torch's own choice for the fake parameter: neither fused nor foreach, the for-loop.
    assert _default_to_fused_or_foreach([fake], differentiable=False, use_fused=False) == (False, False)
    assert resolve_path([type(fake)], ["cuda"], UNSET, torch.optim.Adam) is OptimizerPath.FOR_LOOP
    # The real run's parameter on that device: foreach.
    assert resolve_path([nn.Parameter], ["cuda"], UNSET, torch.optim.Adam) is OptimizerPath.FOREACH
    assert resolve_path([torch.Tensor, nn.Parameter], ["cuda", "cuda"], UNSET, torch.optim.SGD) is OptimizerPath.FOREACH


@pytest.mark.parametrize(
    ("types", "devices", "settings", "optimizer", "expected"),
    [
        ([nn.Parameter], ["cpu"], UNSET, torch.optim.Adam, OptimizerPath.FOR_LOOP),  # no foreach kernels on the CPU
        ([nn.Parameter, nn.Parameter], ["cuda", "cpu"], UNSET, torch.optim.Adam, OptimizerPath.FOR_LOOP),
        ([nn.Parameter], ["cuda"], {**UNSET, "foreach": False}, torch.optim.Adam, OptimizerPath.FOR_LOOP),
        ([nn.Parameter], ["cpu"], {**UNSET, "foreach": True}, torch.optim.Adam, OptimizerPath.FOREACH),
        ([nn.Parameter], ["cuda"], {**UNSET, "fused": True}, torch.optim.AdamW, OptimizerPath.FUSED),
        ([nn.Parameter], ["cuda"], {**UNSET, "fused": False}, torch.optim.Adam, OptimizerPath.FOR_LOOP),
        ([nn.Parameter], ["cuda"], {**UNSET, "differentiable": True}, torch.optim.Adam, OptimizerPath.FOR_LOOP),
        # Adam keeps the for-loop for a tensor learning rate without capturable; SGD does not.
        ([nn.Parameter], ["cuda"], {**UNSET, "lr": torch.tensor(0.1)}, torch.optim.AdamW, OptimizerPath.FOR_LOOP),
        ([nn.Parameter], ["cuda"], {**UNSET, "lr": torch.tensor(0.1)}, torch.optim.SGD, OptimizerPath.FOREACH),
        (
            [nn.Parameter],
            ["cuda"],
            {**UNSET, "lr": torch.tensor(0.1), "capturable": True},
            torch.optim.Adam,
            OptimizerPath.FOREACH,
        ),
    ],
)
def test_the_resolver_follows_torchs_rules(
    types: list[type], devices: list[str], settings: dict[str, Any], optimizer: type, expected: OptimizerPath
) -> None:
    assert resolve_path(types, devices, settings, optimizer) is expected


def _deep_mlp() -> Classifier:
    layers = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU()]
    return Classifier(nn.Sequential(*layers, nn.Linear(64, 10)), OPTIMIZERS["adam"])


def test_a_replay_whose_real_path_is_foreach_holds_adams_intermediate_for_every_parameter_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = _deep_mlp()
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    loop = Predictor(module, None, batch, warm_up=True).baseline()
    monkeypatch.setattr(optimizer_path, "foreach_devices", lambda: ("cpu",))  # as CUDA is: foreach kernels
    foreach = Predictor(module, None, batch, warm_up=True).baseline()
    assert isinstance(loop, ReplayedStep) and isinstance(foreach, ReplayedStep)
    sizes = [parameter.numel() * parameter.element_size() for parameter in module.parameters()]
    assert sizes == [8192, 256, 16384, 256, 16384, 256, 2560, 40]
    # Adam's denominator: the for-loop holds sqrt(exp_avg_sq) and its quotient for one parameter at a time, beside
    # the previous parameter's denominator (its loop variable, rebound after); foreach holds sqrt(exp_avg_sq) of
    # every parameter at once (their sum), divided in place.
    loop_extra = max(previous + 2 * size for previous, size in zip([0, *sizes], sizes, strict=False))
    grown = foreach.phases[Phase.OPTIMIZER].peak_bytes - loop.phases[Phase.OPTIMIZER].peak_bytes
    assert grown == sum(sizes) - loop_extra == 44_328 - 33_024
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert foreach.phases[phase].peak_bytes == loop.phases[phase].peak_bytes


def test_the_twins_optimizer_is_set_to_the_real_path_and_a_users_setting_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _deep_mlp()
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    seen: list[list[bool | None]] = []
    real = make_twin

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made = real(*args, **kwargs)
        seen.append([group["foreach"] for optimizer in made.optimizers for group in optimizer.param_groups])
        return made

    monkeypatch.setattr("lightning_vram.prediction.predictor.make_twin", recorded)
    optimizers = [torch.optim.Adam(module.parameters()), torch.optim.SGD(module.parameters(), lr=0.1, foreach=True)]
    assert isinstance(Predictor(module, optimizers, batch).baseline(), ReplayedStep)
    monkeypatch.setattr(optimizer_path, "foreach_devices", lambda: ("cpu",))
    assert isinstance(Predictor(module, optimizers, batch).baseline(), ReplayedStep)
    assert seen == [[False, True], [True, True]]  # the CPU's for-loop, then foreach; SGD's own setting both times
    assert [group["foreach"] for group in optimizers[0].param_groups] == [None]  # the real optimizer untouched
