"""A step that counts in a ``torch.distributed`` store (the process group's, or one of its own).

A store is shared by every rank and outlives the step: ``store.add`` inside a replay advances the user's count as
a real step would, so the run after it counts differently (under DDP the process group's store counts each rank's
preflight and sampled-step replays; found with two gloo ranks: the user's counts went 5..8 instead of 1..4). A
``HashStore`` stands for it in one process: its ``add`` is a call into C++ that no tensor sees. A store the step's
code reaches is a reason not to replay (``containment/reach.py``'s ``STORE``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import PATHS, Case, assert_untouched
from models import Classifier, linear_net, loader
from torch import nn
from torch.utils.data import TensorDataset

STORE: Any = None


class CountsInAStore(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        STORE.add("user_steps", 1)
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs), targets)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_counting_in_a_store_counts_the_same_with_the_monitor(tmp_path: Path, path: str) -> None:
    def build() -> Case:
        global STORE
        STORE = store = dist.HashStore()
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        count = lambda: store.add("user_steps", 0)  # noqa: E731  # the user's count so far
        return Case(CountsInAStore(linear_net()), loader(data, batch_size=8), observe=count)

    assert_untouched(build, tmp_path, path, attribution_start_step=0, attribution_every_n_steps=1)
