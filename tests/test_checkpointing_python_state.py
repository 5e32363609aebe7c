"""Units whose forward changes Python state or draws from a generator of their own are never checkpointed.

Backward's recomputation runs a checkpointed unit's forward again: a call counter on a module counts twice, and a
``torch.Generator`` the module holds is drawn from again (torch's checkpoint restores only the global generators),
so the checkpointed model would learn another function. The replay of a plan raises where it sees either, and the
plan is discarded saying why; a budget plan or advice printed for such a model, applied as printed, trains the same.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from test_checkpointing_same_model import Trained, assert_same, train
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from lightning_vram import predict
from lightning_vram.prediction.predictor import Predictor
from lightning_vram.records import CheckpointChange, CheckpointPlan, ReplaySkipped

pytestmark = pytest.mark.replay

WIDTH = 256
BATCH = 512


class Counting(nn.Module):
    """Counts its calls (a schedule some layers keep on themselves)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1.0 + 1.0 / (self.calls + 1))


class Noisy(nn.Module):
    """Adds noise from a generator of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn(x.shape, generator=self.generator)


class Averaging(nn.Module):
    """Keeps a moving average of its input in a frozen parameter, updated in place, and centres by it (as an EMA
    codebook or a running normaliser kept as a parameter does): recomputed, it would update the average twice."""

    def __init__(self) -> None:
        super().__init__()
        self.average = nn.Parameter(torch.zeros(WIDTH), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.average


class Recording(nn.Module):
    """Records each call's mean in a list (statistics kept for logging): recomputed, it would record twice."""

    def __init__(self) -> None:
        super().__init__()
        self.means: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.means.append(x.detach().mean())
        return x


KINDS = {"counter": Counting, "generator": Noisy, "average": Averaging, "recording": Recording}
WHY = {
    "counter": "`blocks.2.2.calls` changes each time",
    "generator": "`blocks.1.2.generator` is a torch.Generator",
    # Before, the replay looked at plain values only: the plans were replayed and advised, and applied as printed the
    # average moved twice a step (another model) and the list grew by two a step.
    "average": "`blocks.2.2.average` changes each time its forward runs (a parameter changed in place)",
    "recording": "`blocks.2.2.means` changes each time its forward runs (a list of",
}


class Net(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inputs = nn.Linear(32, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), KINDS[kind](), nn.Linear(WIDTH, WIDTH), nn.ReLU())
            for _ in range(6)
        )
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inputs(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(BATCH * 4, 32, generator=generator), torch.randint(0, 10, (BATCH * 4,), generator=generator)
    )


def trained(kind: str, code: str | None = None) -> Trained:
    torch.manual_seed(0)
    module = Net(kind)
    if code is not None:
        definitions, _, rest = code.partition("\n# in ")
        printed: dict[str, object] = {}
        exec(definitions, printed)
        exec("\n".join(rest.split("\n")[1:]), {**printed, "self": module})
    return train(module, data(), BATCH, steps=4)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_plan_over_units_with_python_state_or_their_own_generator_is_discarded(kind: str) -> None:
    torch.manual_seed(0)
    module = Net(kind)
    batch = data()[:BATCH]
    plan = CheckpointPlan("blocks", (("blocks.1",), ("blocks.2",)), None, 0, forward_of="")
    skipped = Predictor(module, [module.configure_optimizers()], batch).replay(CheckpointChange(plan))
    assert isinstance(skipped, ReplaySkipped)
    assert WHY[kind] in skipped.reason and "another model" in skipped.reason


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_budget_plan_printed_for_units_with_python_state_trains_the_same_model(kind: str) -> None:
    torch.manual_seed(0)
    plain = predict(Net(kind), data()[:BATCH], device_type="cpu").step
    assert plain is not None
    budget = 0.8 * plain.peak.peak_bytes
    torch.manual_seed(0)
    planned = predict(Net(kind), data()[:BATCH], device_type="cpu", memory_budget=int(budget)).budget
    assert planned is not None
    if planned.code is not None:
        assert_same(trained(kind), trained(kind, planned.code))
