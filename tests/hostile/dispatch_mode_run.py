"""A user's dispatch mode spanning each training step, trained with and without the monitor (run as a script).

``python dispatch_mode_run.py PATH ROOT WHERE...``: each ``WHERE`` is ``module`` (the LightningModule enters an op
counter in ``on_train_batch_start`` and leaves it in ``on_train_batch_end``), ``before`` or ``after`` (a Callback
listed before / after the monitor does); ``PATH`` is ``cpu`` or ``cuda``. Writes ``ROOT/outcomes.json``: each
``WHERE``'s outcome, ``"identical"`` when every observable is, else the assertion that failed. The observables: the
flops each step's counter saw, and listed before the monitor, the ops its op counter saw (a mode entered after the
monitor's step began sees autograd save tensors under the monitor's hooks: one ``detach`` more or less). Run in a
child process so that a hang is a timeout, not a stuck test run.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import lightning.pytorch as pl  # noqa: E402 -- after the path the test models need
import torch  # noqa: E402
from harness import Case, assert_untouched  # noqa: E402
from models import Classifier, loader  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The user's own dispatch mode: every op it sees, by name."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Spanning:
    """Enters a flop counter and an op counter at a batch's start, leaves them at its end; keeps what they saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str]]] = []
        self._open: tuple[FlopCounterMode, OpCounter] | None = None

    def start(self) -> None:
        flops, ops = FlopCounterMode(display=False), OpCounter()
        flops.__enter__()
        ops.__enter__()
        self._open = (flops, ops)

    def end(self) -> None:
        assert self._open is not None
        flops, ops = self._open
        ops.__exit__(None, None, None)
        flops.__exit__(None, None, None)
        self.seen.append((flops.get_total_flops(), ops.ops))
        assert ops.ops, "the op counter saw no op"


class SpanningCallback(pl.Callback):
    def __init__(self, spanning: Spanning) -> None:
        self.spanning = spanning

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        self.spanning.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        self.spanning.end()


class SpanningModule(Classifier):
    def __init__(self, network: nn.Module, spanning: Spanning) -> None:
        super().__init__(network)
        self.spanning = spanning

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.spanning.start()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.spanning.end()


def build(where: str) -> Case:
    spanning = Spanning()
    network = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    module = SpanningModule(network, spanning) if where == "module" else Classifier(network)
    callbacks = [] if where == "module" else [SpanningCallback(spanning)]
    return Case(
        module,
        loader(data),
        observe=lambda: spanning.seen if where == "before" else [flops for flops, _ in spanning.seen],
        before_monitor=callbacks if where == "before" else [],
        after_monitor=callbacks if where == "after" else [],
    )


def main(path: str, root: Path, places: list[str]) -> None:
    outcomes: dict[str, str] = {}
    for where in places:
        try:
            assert_untouched(
                partial(build, where),
                root / where,
                path,
                attribution_start_step=0,
                attribution_every_n_steps=1,
            )
        except AssertionError as failed:
            outcomes[where] = f"AssertionError: {failed}"
        else:
            outcomes[where] = "identical"
    (root / "outcomes.json").write_text(json.dumps(outcomes))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
