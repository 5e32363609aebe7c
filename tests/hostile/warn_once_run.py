"""A step that reaches one of torch's warn-once warnings, trained once (run as a script: the once is per process).

``python warn_once_run.py ROOT [PATH]``: trains without the monitor, or with it on ``PATH`` (``cpu`` or ``cuda``),
recording every warning, and prints how many were torch's ``x.T`` deprecation (``TORCH_WARN_ONCE``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import lightning.pytorch as pl  # noqa: E402 -- after the path the test models need
import torch  # noqa: E402
from harness import Case, monitor_for, train  # noqa: E402
from models import dataset_for, loader  # noqa: E402
from torch import nn  # noqa: E402


class TransposesThreeDimensions(pl.LightningModule):
    """Reverses a 3-D tensor's dimensions with ``.T`` (deprecated beyond 2-D: torch warns once a process)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(32, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        restored = inputs.reshape(2, -1, 32).T.T.reshape(-1, 32)
        return nn.functional.cross_entropy(self.net(restored), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(root: str, path: str | None = None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = monitor_for(path, attribution_start_step=1, attribution_every_n_steps=1) if path else None
        train(lambda: Case(TransposesThreeDimensions(), loader(dataset_for("linear"))), Path(root), monitor)
    print(sum("x.T" in str(entry.message) for entry in caught))


if __name__ == "__main__":
    main(*sys.argv[1:])
